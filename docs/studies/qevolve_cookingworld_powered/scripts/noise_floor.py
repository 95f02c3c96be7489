"""Exact permutation test of an arm's per-seed differences against noise-floor differences (the same method with
only its minibatch order changed), both from `agentevo compare ... --baseline` (points vs the same reference).
Prints the mean of each group, the noise draws' sd and the one- and two-sided p over every split of the pooled values.
Usage: python docs/studies/qevolve_cookingworld_powered/scripts/noise_floor.py --arm 2.5 3.0 4.5 --noise -4.0 4.5 1.5 0.5"""
import argparse
import statistics
from itertools import combinations

parser = argparse.ArgumentParser()
parser.add_argument("--arm", type=float, nargs="+", required=True)
parser.add_argument("--noise", type=float, nargs="+", required=True)
args = parser.parse_args()
pooled = args.arm + args.noise
k = len(args.arm)
observed = statistics.mean(args.arm) - statistics.mean(args.noise)
splits = one = two = 0
for pick in combinations(range(len(pooled)), k):
    a = [pooled[i] for i in pick]
    b = [pooled[i] for i in range(len(pooled)) if i not in pick]
    d = statistics.mean(a) - statistics.mean(b)
    splits += 1
    one += d >= observed - 1e-9
    two += abs(d) >= abs(observed) - 1e-9
print(f"arm mean {statistics.mean(args.arm):+.2f}, noise mean {statistics.mean(args.noise):+.2f} "
      f"(sd {statistics.stdev(args.noise):.2f}, {len(args.noise)} draws); difference {observed:+.2f}; "
      f"p one-sided {one}/{splits} = {one / splits:.3f}, two-sided {two}/{splits} = {two / splits:.3f}")
