"""Small leaves for files rlcli writes and reads: whole-or-nothing writes, JSONL rows."""
