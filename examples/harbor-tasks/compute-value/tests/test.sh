#!/bin/bash
# Reward 1 when /app/answer.txt holds 4 (ana, dee, eli, gus score above 50).
mkdir -p /logs/verifier
if [ "$(tr -d '[:space:]' < /app/answer.txt 2>/dev/null)" = "4" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
