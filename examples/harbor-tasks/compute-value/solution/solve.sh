#!/bin/bash
awk -F, 'NR > 1 && $3 > 50 { n++ } END { print n + 0 }' /app/scores.csv > /app/answer.txt
