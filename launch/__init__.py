"""The composition root: turns flags (or API keyword arguments) into one resolved Config (parse, resume, check,
tune, in that order, once), builds what lies around the core, and hands it all to the runner.

``run.py`` and the installed ``spreeze`` command both enter here. ``spreeze/`` never imports this package,
``viz`` or ``autotune``; this package imports all three."""
