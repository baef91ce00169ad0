set -x
T37=0 source .devrun/setup.sh
python3 .devrun/gl_bench.py
T37=1 source .devrun/setup.sh
python3 .devrun/gl_bench.py
