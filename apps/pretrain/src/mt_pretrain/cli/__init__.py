"""The `mt` command line: the Typer app, `mt pretrain`'s flags, `mt plan`, `mt matrix` and
`mt plot`."""
