import os
import sys

# tests import the shared harness as `tests.distributed`
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
