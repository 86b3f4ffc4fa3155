"""Faults and load: the drills, the soak, API fuzzing, conversation migration."""
