import os
import sys

# Tests import the shared oracle as a plain module.
sys.path.insert(0, os.path.dirname(__file__))
