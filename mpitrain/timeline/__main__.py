import sys

from mpitrain.timeline.summary import main

sys.exit(main())
