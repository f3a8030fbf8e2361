"""One module per lesson: ``lNN_topic.py`` holds lesson NN's experiments and plots, nothing else.

See CONTRIBUTING.md ("Rooms") for where everything else lives.
"""
