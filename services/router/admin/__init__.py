"""The admin API, its key routes and the ``epd admin`` command."""
