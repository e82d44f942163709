"""The ``sluice`` commands: the command line and what each subcommand runs."""
