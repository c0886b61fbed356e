#!/bin/bash
# Reward 1 when /app/sum.sh sums a file it has not seen.
mkdir -p /logs/verifier
printf '10\n-3\n25\n100\n' > /tmp/rlcli-check-numbers.txt
if [ "$(bash /app/sum.sh /tmp/rlcli-check-numbers.txt 2>/dev/null)" = "132" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
