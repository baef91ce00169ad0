T37=0 source .devrun/setup.sh
export PYTHONPATH=$PYTHONPATH:$PWD
python3 -m pytest -m gpu tests/megamoe/test_triton_gpu.py -x -q -p no:cacheprovider 2>&1 | tail -15
G="96,128,64,128,64,8,6,1,0,1,1;96,128,64,128,64,8,4,1,0,1,1;96,64,64,64,64,4,6,1,0,1,1;96,64,64,64,64,4,4,1,0,1,1;96,64,64,64,64,4,6,1,168,1,1;64,128,64,128,64,8,4,1,128,1,0"
python3 bench/megamoe_gpu.py --sweep --tokens 4096 --configs "$G" --iters 10 2>&1 | grep -v "^  T=" | tail -12
python3 bench/megamoe_gpu.py --sweep --tokens 1024,4096 --hidden 2048 --intermediate 1408 --experts 64 --configs "$G;128,128,64,128,64,8,4,1,0,0,0" --iters 10 2>&1 | grep -v "^  T=" | tail -12
T37=1 source .devrun/setup.sh
export PYTHONPATH=$PYTHONPATH:$PWD
python3 -m pytest -m gpu tests/megamoe/test_triton_gpu.py -x -q -p no:cacheprovider -k gluon 2>&1 | tail -3
python3 bench/megamoe_gpu.py --sweep --tokens 4096 --configs "$G" --iters 10 2>&1 | grep -v "^  T=" | tail -12
