T37=0 source .devrun/setup.sh >/dev/null 2>&1
export PYTHONPATH=$PYTHONPATH:$PWD
GL_SYNC=1 python3 .devrun/dg.py 2>&1 | grep -v Warn | tail -6
GL_SYNC=0 python3 .devrun/dg.py 2>&1 | grep -v Warn | tail -6
T37=1 source .devrun/setup.sh >/dev/null 2>&1
export PYTHONPATH=$PYTHONPATH:$PWD
GL_SYNC=1 python3 .devrun/dg.py 2>&1 | grep -v Warn | tail -6
