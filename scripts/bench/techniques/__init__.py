"""What each memory technique saves and what it costs, measured."""
