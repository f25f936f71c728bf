"""``python -m accelrun``: the ``accelrun`` command."""

from accelrun.cli.main import main

main()
