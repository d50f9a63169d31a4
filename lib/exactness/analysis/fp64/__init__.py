"""The FP64 per-class receipt: references (ref.py), certified bounds (cert.py), synthetic inputs (synth.py), the section (section.py) and its report (report.py)."""
