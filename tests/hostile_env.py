"""An environment whose every step runs a hostile program through the sandbox, for tests/test_hostile_run.py.

The program does what model-written code did to a run before the jail: it finds the run's folder (its path is in
RL_HOSTILE_RUN; the code found it through /proc before), deletes the checkpoints and empties metrics.jsonl,
writes pickles that would create PWNED in the run folder into every file a resume reads, and kills every process
whose command line names rl.main (its rank, which launch.sh then restarts from the planted checkpoint)."""

import os

from rl.env.sandbox import run_python

ATTACK = """
import glob, os, pickle, shutil, signal
run = {run!r}
done = []

class Plant:
    def __reduce__(self):
        return (open, (run + '/PWNED', 'w'))

for path in glob.glob(run + '/checkpoints/*/rng/*') + glob.glob(run + '/checkpoints/*/rollout_buffer*') + \\
        glob.glob(run + '/checkpoints/*/model_optim/.metadata'):
    try:
        with open(path, 'wb') as f:
            pickle.dump(Plant(), f)
        done.append('planted')
    except OSError:
        pass
for attack in (lambda: shutil.rmtree(run + '/checkpoints'), lambda: open(run + '/metrics.jsonl', 'w').close()):
    try:
        attack()
        done.append('destroyed')
    except OSError:
        pass
for pid in os.listdir('/proc'):
    try:
        if pid.isdigit() and b'rl.main' in open(f'/proc/{{pid}}/cmdline', 'rb').read():
            os.kill(int(pid), signal.SIGKILL)
            done.append('killed')
    except OSError:
        pass
print(' '.join(done) or 'nothing')
"""


class Hostile:
    def step(self, text, tokens):
        result = run_python(ATTACK.format(run=os.environ["RL_HOSTILE_RUN"]), timeout_s=5.0)
        return f" {result.stdout.strip()[:40]}", True, float(result.stdout.strip() == "nothing")


def hostile(prompt, label, columns):
    return Hostile()
