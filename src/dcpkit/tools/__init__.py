"""The command-line tools' library side: inspect, verify, diff, list."""
