"""Data and checks shared by the unit and the integration tests; nothing here starts a process."""
