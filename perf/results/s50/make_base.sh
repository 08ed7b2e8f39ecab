# Run here before `ab.sh`'s device call: main before session 50's merge (5ed5364) as an importable tree under the
# ignored out/s50base (carry it: `carry [".whl", "out/s50base"]`); the device machine's tree has no git history.
set -e
rm -rf out/s50base /tmp/s50base_src && mkdir -p out/s50base /tmp/s50base_src
git archive 5ed5364 kvbackend kernels tiers integration | tar -x -C /tmp/s50base_src
cp -r /tmp/s50base_src/kvbackend out/s50base/
for sub in kernels tiers integration; do cp -r /tmp/s50base_src/$sub out/s50base/kvbackend/$sub; done
find out/s50base -name __pycache__ -prune -exec rm -rf {} \;
