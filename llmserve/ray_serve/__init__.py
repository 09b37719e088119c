"""llmserve on Ray Serve (`llmserve serve --ray`, the `.[ray]` extra).

  Ray Serve HTTP proxy -> Ingress deployment (the same Starlette app as `llmserve serve`:
                          validation, chat template, tokenization, response caches, SSE)
                          client: RayEngineClient (client.py), the engine door over a
                          DeploymentHandle, routed by PrefixAwareRouter (router.py)
                       -> Engine deployment, N replicas (replica.py): each one llmserve engine
                          core process behind a local EngineCoreClient, streaming RequestOutputs
  StatsBoard (board.py): a small actor where replicas post their EngineStats and step times
                          and the ingress reads them (/stats, /metrics, the dashboard)

app.py builds the application and runs `llmserve serve --ray`.
"""
