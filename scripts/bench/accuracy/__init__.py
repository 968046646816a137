"""Does the estimate hold the measured step? memtrain's prediction against an independent count."""
