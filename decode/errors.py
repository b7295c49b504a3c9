"""The one exception type for bad user input.

CLIs catch `UserError` and print its message as a single line (no traceback); library code raises
it whenever the caller gave something impossible (unknown preset, unreadable image, empty prompt,
mismatched checkpoint ...). The message says what is wrong and how to fix it.
"""


class UserError(Exception):
    """Bad input from the user; `str(err)` is a one-line message with the fix."""
