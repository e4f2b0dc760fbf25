"""`epirl compare`: one recipe trained under several engine/trainer pairings and seeds, evaluated on a held-out
set, summarised in one table.

spec      the study (`CompareSpec`), pairings, seeds
heldout   the arithmetic held-out set and each seed's training list without it
plan      run names, folders, and what each run needs given what is on disk
execute   runs and evaluations in their own processes, side by side over GPUs
evaluate  the held-out evaluation of one adapter (`python -m epirl.compare.evaluate`)
stats     bootstrap intervals of accuracy and of paired differences
collect   run folders → per-run and per-pairing results
report    summary.md, summary.json, curves.png
study     all of the above in order (`run_study`)
"""
