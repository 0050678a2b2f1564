"""`python -m hpcml` (also what torchrun runs with `-m hpcml`)."""

from hpcml.cli.app import main

if __name__ == "__main__":
    main()
