export PYTHONPATH=$PWD/lib PYTHONUNBUFFERED=1; timeout 200 python3 .before/split_rows.py 2>&1 | tail -45
