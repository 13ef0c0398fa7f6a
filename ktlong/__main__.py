"""`python -m ktlong` runs the CLI."""
from ktlong.cli import main

if __name__ == "__main__":
    main()
