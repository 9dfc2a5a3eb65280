#!/usr/bin/env python3
"""The fault matrix's per-case table (docs/BENCHMARKS.md) from ctest -V logs of fault_matrix_test.

usage: bench/fault_matrix_report.py LOG [LOG...]
Reads every "FAULT <case> ..." line; per case: runs, load, requests, affected share, and the
median / max over the runs of each run's worst time to final status (affected requests, and any
request in flight at the fault or sent after it), of the first right answer sent after the fault
and of the victim being healthy again (seconds), and the re-registrations per run.
"""
import re
import statistics as st
import sys
rows={}
for f in sys.argv[1:]:
    for line in open(f):
        m=re.search(r'FAULT (\S+)(?: round \d+)?: capacity ([\d.]+) req/s, load ([\d.]+) req/s, (\d+) requests, (\d+) affected \(([\d.]+)%\), worst time to final status after the fault ([\d.]+) s \(any request ([\d.]+) s.*?first right answer sent after the fault ([-\d.]+) s after it(?:, victim healthy again after ([\d.]+) s)?(?:, (\d+) re-registrations)?',line)
        if not m: continue
        name=m.group(1)
        rows.setdefault(name,[]).append(dict(load=float(m.group(3)),n=int(m.group(4)),aff=float(m.group(6)),wf=float(m.group(7)),anyr=float(m.group(8)),ok=float(m.group(9)),back=float(m.group(10)) if m.group(10) else None,rereg=int(m.group(11)) if m.group(11) else None))
def mm(v): return "%.2f / %.2f"%(st.median(v),max(v))
order=["kill_prefill","stop_prefill","kill_decode","stop_decode","kill_tp_follower","stop_tp_follower","kill_coordinator","stop_coordinator","long_stop_coordinator","cut_kv_link","corrupt_kv_chunk","blackhole_kv_link"]
print("| fault | runs | load (req/s) | requests | affected (median, range) | affected: final status (median / max of the per-run worst) | any request in flight or sent after: final status (median / max) | first right answer sent after | victim healthy again | re-registrations |")
print("|---|---|---|---|---|---|---|---|---|---|")
for k in order:
    r=rows.get(k)
    if not r: continue
    affected=[x for x in r if x['aff']>0]
    print("| %s | %d | %.1f–%.1f | %d | %.1f%% (%.1f–%.1f%%) | %s | %s | %s | %s | %s |"%(k,len(r),min(x['load'] for x in r),max(x['load'] for x in r),sum(x['n'] for x in r),st.median([x['aff'] for x in r]),min(x['aff'] for x in r),max(x['aff'] for x in r),
      mm([x['wf'] for x in affected]) if affected else "—", mm([x['anyr'] for x in r]), mm([x['ok'] for x in r]), mm([x['back'] for x in r if x['back'] is not None]) if r[0]['back'] is not None else "—", ",".join(str(x['rereg']) for x in r) if r[0]['rereg'] is not None else "—"))
