"""One exception type for user mistakes: stage CLIs print its message as one line and exit 2."""


class QerlError(Exception):
    """A user-facing error (bad config, bad file, bad tensor). The message names the culprit."""
