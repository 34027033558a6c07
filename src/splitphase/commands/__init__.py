"""What each CLI command does; `splitphase.cli` only parses arguments and calls these."""
