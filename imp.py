import sys
import numpy, scipy, pandas
if sys.argv[1] != "plain":
    import rustws
    ws = rustws.workspace("W")
    if sys.argv[1] == "cyc":
        for _ in ws.cycles(range(3)): pass
print(sys.argv[1], [l for l in open("/proc/self/status") if l.startswith(("VmHWM","VmRSS"))])
