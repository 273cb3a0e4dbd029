"""The split every bench command makes of its command line: its own arguments before `--`,
`gapless serve`'s after. Imports nothing, so a command may call it before torch loads."""

from __future__ import annotations


def split_serve_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the bench command's arguments, the serve arguments after `--`)."""
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1 :]
