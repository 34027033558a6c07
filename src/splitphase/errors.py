"""The one base class for errors a user can fix; the CLI prints these as one line, exit code 2."""


class UserError(ValueError):
    """Bad input, configuration or environment, with a message that says what to change."""
