"""Watching a run: the live reward-curve window (:mod:`viz.live`), the policy-visualization process
(:mod:`viz.render`), and the command-line tools ``python -m viz.plot`` and ``python -m viz.play``.

Everything here runs beside training, never inside it: the window and the renderer are their own
low-priority processes fed without blocking, so a slow, closed or crashed view cannot stall the learner.
"""
