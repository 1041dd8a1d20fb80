"""Names of the records and keys that travel in Flower messages (one place for all)."""

ARRAYS = "arrays"  # ArrayRecord: model weights (dense), server -> site and site -> server
CONFIG = "config"  # ConfigRecord: server -> site instructions
METRICS = "metrics"  # MetricRecord: site -> server numbers
SITE = "site"  # ConfigRecord: site -> server identity
SPARSE_UPDATE = "sparse-update"  # ConfigRecord: site -> server top-k delta (fedind.topk.codec)
TOPK_ESTIMATE = "topk-estimate"  # ConfigRecord {"token": str}: EF21 estimate the server holds / the site's delta is relative to
TOKEN = "token"
ENCRYPTED_UPDATE = "encrypted-update"  # ConfigRecord: site -> server Paillier ciphertexts (fedind.paillier.packing)
ENCRYPTED_AGGREGATE = "encrypted-aggregate"  # ConfigRecord: server -> decrypting site, the summed ciphertexts
AGGREGATE = "aggregate"  # ArrayRecord: decrypting site -> server, the decrypted weighted mean delta
PAILLIER_SET = "paillier-set"  # ConfigRecord, server -> site: the round's coordinate set of a sparse encrypted round
SET_INDICES = "indices"  # its key: sorted uint32 little-endian indices into the flat model (fedind.paillier.sparse)
SET_DIGEST = "digest"  # its key: set_digest(indices, model size, round), which the site's payload names
SUM_OF = "sum-of"  # ConfigRecord key of a decrypt query: "update" (the round's sum, the default) | "side" (fedind.paillier.sums)
HOLDER_ROWS = "holder-rows"  # ConfigRecord, server -> site in encrypted rounds: {"from": k}, rows of classes >= k averaged over their holders
HOLDER_ROWS_FROM = "from"  # its key

# Error codes of site replies (Flower's ``Error.code``; Flower's own are below 1000), each distinct
REJECTED_PAYLOAD = 1001  # the server could not decode a sparse (top-k) payload
REJECTED_CIPHERTEXT = 1002  # the server refused an encrypted payload (fedind.server.encrypted)
SITE_KEY_MISSING = 1003  # a site cannot load its private key (fedind.paillier.site)
STALE_DOWNLINK = 1004  # a site does not hold the base a downlink step refers to (fedind.topk.downlink)
REJECTED_UPDATE = 1005  # the server screened a train reply out (fedind.server.screening)
SITE_ABSENT = 1006  # a simulated line off the network (simulations/)
SUM_OUT_OF_RANGE = 1007  # the decrypting site found a sum honest sites cannot produce (fedind.paillier.packing.sum_fault)
ERROR_CODES = {REJECTED_PAYLOAD: "rejected-payload", REJECTED_CIPHERTEXT: "rejected-ciphertext",
               SITE_KEY_MISSING: "site-key-missing", STALE_DOWNLINK: "stale-downlink",
               REJECTED_UPDATE: "rejected-update", SITE_ABSENT: "site-absent",
               SUM_OUT_OF_RANGE: "sum-out-of-range"}

# ConfigRecord keys, server -> site
SERVER_ROUND = "server-round"  # set by Flower's strategies
RUN_CONFIG = "run-config"  # JSON text of the run config (sites read hyperparameters from it)
LR = "lr"  # the run's learning-rate, under the name Flower's quickstart ClientApps read
LOCAL_EPOCHS = "local-epochs"  # the run's local-epochs, likewise (fedind's agent reads RUN_CONFIG)

# MetricRecord keys, site -> server
NUM_EXAMPLES = "num-examples"  # Flower's default weighting key
TRAIN_LOSS = "train-loss"  # Flower's usual metric; fedind's sites do not send it (the server reads no loss)
LABEL_HISTOGRAM = "label-histogram"  # list[int], one count per class of the global model
TRAIN_SECONDS = "train-seconds"  # CPU seconds of local training
PEAK_RSS_MB = "peak-rss-mb"  # peak resident memory of the site agent's process, MiB
COMPRESS_SECONDS = "compress-seconds"  # CPU seconds of sparsifying + encoding the update
ENCRYPT_SECONDS = "encrypt-seconds"  # seconds the site waited after training to encrypt its update
CLIPPED_VALUES = "clipped-values"  # update values clipped to [-paillier-clip, paillier-clip] before encryption

# ConfigRecord keys, site -> server
SITE_ID = "site-id"

# MetricRecord keys, strategy -> server app (the aggregated train metrics of a round)
CONFLICT_SHARE = "conflict-share"  # share of coordinates whose sign agreement is below the threshold
DWA_WEIGHT_MIN = "dwa-weight-min"  # smallest aggregation weight given to a site this round
DWA_WEIGHT_MAX = "dwa-weight-max"  # largest aggregation weight given to a site this round
CCLIP_SHARE = "cclip-share"  # share of the round's buckets that centered clipping shortened
RESTART_SHARE = "restart-share"  # share of coordinates whose server momentum was reset this round

# Continual learning (fedind.continual.phases)
PHASE_END = "query.phase_end"  # message type, server -> every site at the end of a phase: consolidate
PHASE = "phase"  # ConfigRecord key, server -> site: the phase that ends
EWC_FISHER = "ewc-fisher"  # ArrayRecord: site -> server its Fisher (phase end); server -> site the consolidated one
EWC_ANCHORS = "ewc-anchors"  # ArrayRecord, server -> site: the anchor parameters of the EWC penalty
CALIBRATE = "query.calibrate"  # message type, server -> every site after the run's last round (head-calibration): send feature moments
FEATURE_MOMENTS = "feature-moments"  # ConfigRecord, site -> server: per-class feature moments (fedind.continual.calibration.encode_moments)
# Under encryption the two side sums travel as Paillier payloads (fedind.paillier.sums), never in the clear
EWC_FISHER_ENCRYPTED = "ewc-fisher-encrypted"  # ConfigRecord, site -> server: its Fisher, flat, as a per-example mean
FEATURE_MOMENTS_ENCRYPTED = "feature-moments-encrypted"  # ConfigRecord, site -> server: fedind.continual.calibration.moments_vector
CLASSES_SEEN = "classes-seen"  # MetricRecord key, site -> server: 1 + the largest label in the site's data
# ConfigRecord of a train reply from a site whose data has classes the head lacks (not in the
# MetricRecord: Flower's strategies want the same metric keys in every reply)
NEW_CLASSES = "new-classes"
NEW_ROWS = "rows"  # its key: the proposed head rows of those classes, then their biases, flat
NEW_COUNTS = "counts"  # its key: the site's training windows of each of those classes
REFIT_FROM = "refit-from"  # key of the same-named ConfigRecord in a train message: refit the rows from this class on
REPLAY_SAMPLES = "replay-samples"  # MetricRecord key: windows in the site's replay buffer
REPLAY_BYTES = "replay-bytes"  # MetricRecord key: bytes the site's replay buffer holds (ReplayBuffer.nbytes)
WINDOWS_SEEN = "windows-seen"  # MetricRecord key: windows the site has had (earlier phases offered + this batch)

# Compressed downlink (fedind.topk.downlink)
DOWNLINK = "downlink"  # ConfigRecord, server -> site: {"token": digest of the model it is sent, "base"?, "cached:<record>"...}
DOWNLINK_BASE = "base"  # its key: the digest of the model the sparse step applies to
DOWNLINK_INIT = "init"  # its key: JSON spec of the run's initial model, which the site builds itself (fedind.models.initial_state)
DOWNLINK_MOMENTUM = "momentum"  # its key: beta of the predicted step, P_{t-1} + beta (P_{t-1} - P_{t-2}) + step (downlink-momentum)
DOWNLINK_ORDER = "order"  # its key: the model's array names, in order (with a step)
DOWNLINK_WHOLE = "downlink-whole"  # ArrayRecord, server -> site: arrays of the new model that changed shape (a grown head), whole
DOWNLINK_VELOCITY = "downlink-velocity"  # ArrayRecord, server -> site with a whole model: the copy's last move (downlink-momentum)
DOWNLINK_STEP = "downlink-step"  # ConfigRecord, server -> site: the sparse step of the broadcast model (fedind.topk.codec payload)
SPARSE_RECORD = "packed:"  # ArrayRecord name prefix: a mostly-zero record in compact form (fedind.topk.downlink.pack_sparse)
CACHED_RECORD = "cached:"  # key prefix in DOWNLINK: an array record left out because the site holds it (value: its digest)


def stamp_message_id(message, message_id: str) -> None:
    """Give a Flower ``Message`` the id a grid would: ``Metadata`` has no setter for it
    (Flower assigns ids when it pushes a message), so this is the one place that writes the
    private field. Here, not beside the loopback grid, because the site relay's cost
    benchmark uses it too and must not import torch."""
    message.metadata.__dict__["_message_id"] = message_id
