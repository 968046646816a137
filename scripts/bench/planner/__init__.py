"""The planner: does its choice fit and run fast, how long it takes, how long a context it plans."""
