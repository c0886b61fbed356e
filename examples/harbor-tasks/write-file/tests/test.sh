#!/bin/bash
# Reward 1 when /app/greeting.txt is exactly "hello, harbor\n".
mkdir -p /logs/verifier
if printf 'hello, harbor\n' | cmp -s - /app/greeting.txt; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
