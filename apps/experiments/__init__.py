"""The drifting-preference experiment (issue 6): style classifier, judge, judge service,
simulated users, metrics and report. See apps/experiments/scenario.py for what arms share."""
