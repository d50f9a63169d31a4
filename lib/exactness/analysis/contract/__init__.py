"""The kernel contract: every prompt kernel's rows against the decode kernel it replaces, as bytes (check.py: the section; cases.py, inputs.py: what is fed; report.py: tables and plots)."""
