"""``python -m sparda``: the same CLI as the ``sparda`` command (:mod:`sparda.cli`)."""

from sparda.cli import main

if __name__ == "__main__":
    main(prog_name="sparda")
