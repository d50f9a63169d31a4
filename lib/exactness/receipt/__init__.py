"""The receipt harness.

    sections.py  THE section table; params.py: typed parameters; profiles.py: run profiles
    preflight.py, overrides.py: a run's parameters and the checks before anything runs; runner.py + runfolder.py:
                 the papermill run into one folder
    render.py    receipt.md; page.py: receipt.html; tables.py: table formatting; env.py: the environment record
    diff.py      what moved between two receipts (diff_md.py, diff_bench.py); cli.py: python -m exactness
"""
