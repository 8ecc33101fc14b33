import sys

from nodesampler.cli import main

sys.exit(main())
