"""Rich views of the core's data, and where each message goes (logging or the console)."""
