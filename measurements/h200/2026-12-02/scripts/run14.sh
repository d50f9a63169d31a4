export PYTHONPATH=$PWD/lib PYTHONUNBUFFERED=1; timeout 200 python3 .before/split_loop2.py 2>&1 | tail -30
