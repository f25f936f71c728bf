"""``python -m accelrun``: the ``accelrun`` command."""

from accelrun.cli.main import main

if __name__ == "__main__":
    main()
