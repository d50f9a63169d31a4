"""Run `python -m exactness ARGS` under cProfile for at most SECS seconds; write the top functions to OUT."""
import cProfile, io, pstats, signal, sys, time
sys.path.insert(0, "lib")
secs, out, argv = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
from exactness.receipt.cli import main


class Stop(BaseException):
    pass


def stop(*_):
    raise Stop()


signal.signal(signal.SIGALRM, stop)
signal.alarm(secs)
pr = cProfile.Profile()
t0 = time.perf_counter()
pr.enable()
try:
    main(argv)
    how = "finished"
except Stop:
    how = "stopped"
finally:
    pr.disable()
    s = io.StringIO()
    s.write(f"{argv}: {how} after {time.perf_counter() - t0:.1f} s\n")
    st = pstats.Stats(pr, stream=s)
    st.sort_stats("tottime").print_stats(45)
    st.sort_stats("cumulative").print_stats(70)
    open(out, "w").write(s.getvalue())
