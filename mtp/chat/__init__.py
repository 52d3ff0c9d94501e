"""`mtp-chat`: the interactive chat application (cli.py wires session.py, turn.py and terminal.py)."""
