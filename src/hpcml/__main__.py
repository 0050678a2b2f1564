"""`python -m hpcml` (also what torchrun runs with `-m hpcml`)."""

from hpcml.cli.app import run

if __name__ == "__main__":
    run()
