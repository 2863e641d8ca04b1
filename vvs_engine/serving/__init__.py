"""``vvs-engine serve``: an OpenAI-shaped image-generation HTTP server on the one decode loop.

* ``worker``  the engine thread (owns the device, runs ``runtime.loop.serve``) and its request queue;
* ``app``     the asyncio front end (FastAPI): the API, streaming, cancellation, deadlines;
* ``schemas`` the request body and its checks (400/413/422 as one-line JSON);
* ``metrics`` Prometheus metrics in the text format;
* ``page``    ``GET /``, a self-contained HTML page;
* ``cli``     the command: flags, warm-up, bind, graceful SIGTERM;
* ``ray_serve`` ``serve --ray --num-replicas N``: the same app as a Ray Serve deployment.

FastAPI and uvicorn come with the ``[serve]`` extra, Ray Serve with ``[ray]``; importing this package
needs none of them.
"""
