"""The audit's subcommands: `audit`, `pairs`, `engines` (audit.py), `record`, `diff`, `replay`
(blackbox.py, record.py) and the argument types they share with `bench` (args.py). The `specaudit`
command itself is `specaudit.cli`."""
