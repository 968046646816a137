"""The measured side: counters and model builders that share no code with memtrain."""
