/* One reliable-connected (RC) queue pair with its own verbs objects, compiled.
 *
 * The same endpoint as pyverbs_endpoint.py, without the interpreter on
 * the hot path: under emulation every Python instruction costs, and pyverbs
 * ships no .pxd, so this module owns its device context, protection domain,
 * completion queue (with a completion channel), queue pair and memory
 * regions itself, declared from <infiniband/verbs.h>.
 *
 * - Work requests live in this struct or on the stack: nothing is allocated
 *   per post. Receives go back in chained batches of RECV_BATCH (one doorbell).
 * - Credits may be owed (owe(), while `deferring`): they lead the next chain
 *   posted, so a released slot's credit and the next write share a doorbell
 *   (and, on SoftRoCE, the one system call a post costs). An owed credit
 *   rides inside a write's own immediate where both fit a PAIR immediate
 *   (providers/contract.py's pair_imm): one work request, one packet, not two.
 * - Every post is bounds-checked first: the source must lie inside memory
 *   registered local-only with this endpoint, the destination inside the
 *   remote region; otherwise TransportError and nothing is posted.
 * - Sends are numbered 1, 2, 3... (the wr_id); an RC send queue completes in
 *   order, so a caller knows a send is done once a later or equal number is.
 *   Receives carry RECV_TAG in their wr_id, so even a flushed completion
 *   (whose opcode is undefined) says which queue it came from.
 * - poll() may spin and wait_event() blocks on the completion channel, both
 *   with the GIL released; close() wakes such a thread and waits for it
 *   before it frees anything, children first (QP, MRs, CQ, channel, PD,
 *   context), and is idempotent.
 * - Immediates travel as the raw 32-bit field, as pyverbs does, so the two
 *   endpoints talk to each other.
 *
 * Errors are rdmatensor's own: DeviceError (no device, port down),
 * VerbsError (a verbs call failed, its errno named), TransportError (a bad
 * post), UsageError (memory that cannot be registered).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include <infiniband/verbs.h>

#define RECV_BATCH 16                      /* receives given back per doorbell */
#define RECV_TAG (1ULL << 63)              /* marks a receive's wr_id */
#define MAX_POLL 64                        /* completions taken per poll() */
#define MAX_CHAIN 32                       /* writes posted per doorbell by post_writes() */
#define MAX_REGION (4ULL << 30)
#define INLINE_WANTED 64                   /* small writes go inline when the device allows */
#define SLEEP_LOOK 0.01                     /* a sleeping waiter looks at its flag this often */
#define SCRATCH_BYTES 64                   /* receives need an SGE; immediates never fill it */
#define IMM_CREDIT 1u                      /* providers/contract.py's immediates: kind (2 bits), tag, index */
#define IMM_PAIR 2u
#define PAIR_BITS 15

static PyObject *DeviceError, *VerbsError, *TransportError, *UsageError;

/* ------------------------------------------------------------------ MR */

typedef struct {
    PyObject_HEAD
    struct ibv_mr *mr;
    Py_buffer view;          /* keeps the registered memory alive until deregistered */
    int has_view;
    uint64_t addr;
    uint64_t length;
    uint32_t lkey, rkey;
    int access;
} MemoryRegion;

static void mr_release(MemoryRegion *self)
{
    if (self->mr) {
        ibv_dereg_mr(self->mr);
        self->mr = NULL;
    }
    if (self->has_view) {
        PyBuffer_Release(&self->view);
        self->has_view = 0;
    }
}

static void mr_dealloc(MemoryRegion *self)
{
    mr_release(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *mr_get_addr(MemoryRegion *s, void *c) { return PyLong_FromUnsignedLongLong(s->addr); }
static PyObject *mr_get_length(MemoryRegion *s, void *c) { return PyLong_FromUnsignedLongLong(s->length); }
static PyObject *mr_get_lkey(MemoryRegion *s, void *c) { return PyLong_FromUnsignedLong(s->lkey); }
static PyObject *mr_get_rkey(MemoryRegion *s, void *c) { return PyLong_FromUnsignedLong(s->rkey); }
static PyObject *mr_get_access(MemoryRegion *s, void *c) { return PyLong_FromLong(s->access); }
static PyObject *mr_get_closed(MemoryRegion *s, void *c) { return PyBool_FromLong(s->mr == NULL); }

static PyGetSetDef mr_getset[] = {
    {"addr", (getter)mr_get_addr, NULL, "first byte registered", NULL},
    {"length", (getter)mr_get_length, NULL, "bytes registered", NULL},
    {"lkey", (getter)mr_get_lkey, NULL, "local key", NULL},
    {"rkey", (getter)mr_get_rkey, NULL, "remote key (what a peer writes with)", NULL},
    {"access", (getter)mr_get_access, NULL, "ibv_access_flags", NULL},
    {"closed", (getter)mr_get_closed, NULL, "deregistered", NULL},
    {NULL},
};

static PyTypeObject MemoryRegionType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "rdmatensor.providers.verbs._native_endpoint.MemoryRegion",
    .tp_doc = "Memory registered with an Endpoint (Endpoint.register); freed by deregister or close.",
    .tp_basicsize = sizeof(MemoryRegion),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)mr_dealloc,
    .tp_getset = mr_getset,
};

/* ------------------------------------------------------------ Endpoint */

typedef struct {
    PyObject_HEAD
    struct ibv_context *ctx;
    struct ibv_pd *pd;
    struct ibv_comp_channel *channel;
    struct ibv_cq *cq;
    struct ibv_qp *qp;
    struct ibv_mr *scratch_mr;
    void *scratch;
    PyObject *mrs;                         /* list of MemoryRegion, closed before the PD */
    Py_ssize_t last_source;                /* index in mrs of the last source found */
    int wake_fd;                           /* close() wakes blocked waiters through it */
    int nudge_fd;                          /* a waiter that would sleep on the channel ends wait_event() */
    int busy;                              /* threads inside a GIL-released section */
    int closing, closed;
    char device[64];
    int port, gid_index;
    union ibv_gid gid;
    int active_mtu;                        /* enum ibv_mtu */
    uint32_t psn;
    int depth, recv_depth;
    uint32_t max_inline;
    uint64_t sends_posted, sends_completed; /* numbered sends: room in the send queue */
    uint64_t arrivals;                     /* receives completed well: each one the peer's CPU posted */
    int recv_owed;                         /* consumed receives not yet given back */
    uint32_t owed[MAX_CHAIN];              /* immediates owed (credits): they lead the next chain posted */
    int n_owed;
    int deferring;                         /* owe() takes immediates only while this is set */
    PyObject *on_owed;                     /* called once (then cleared) when owe() next takes one */
    uint64_t woken_waiting, woken_waiter;  /* CQ events taken by wait_event(); waits ended asleep on the channel */
    uint64_t handed_over;                  /* waits left to another thread: it held the poll or the event lock */
    int halted;                            /* prepared writes post nothing while this is set */
    struct ibv_recv_wr recv_wrs[RECV_BATCH];
    struct ibv_sge recv_sges[RECV_BATCH];
} Endpoint;

static PyObject *verbs_error(const char *what, int err)
{
    PyErr_Format(VerbsError, "%s: %s (errno %d)", what, strerror(err), err);
    return NULL;
}

static int check_open(Endpoint *self)
{
    if (self->closed || self->closing) {
        PyErr_SetString(TransportError, "the verbs endpoint is closed");
        return -1;
    }
    return 0;
}

/* Free every verbs object, children first. Called with the GIL held. */
static void ep_release(Endpoint *self)
{
    if (self->closing || self->closed)
        return;            /* done, or another thread is at it */
    __atomic_store_n(&self->closing, 1, __ATOMIC_RELEASE);
    if (self->wake_fd >= 0) {
        uint64_t one = 1;
        if (write(self->wake_fd, &one, sizeof one) < 0) { /* a full counter wakes them as well */ }
    }
    if (__atomic_load_n(&self->busy, __ATOMIC_ACQUIRE)) {
        Py_BEGIN_ALLOW_THREADS
        for (int i = 0; i < 100000 && __atomic_load_n(&self->busy, __ATOMIC_ACQUIRE); i++)
            usleep(50);
        Py_END_ALLOW_THREADS
    }
    self->closed = 1;
    if (self->qp) { ibv_destroy_qp(self->qp); self->qp = NULL; }
    if (self->mrs) {
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(self->mrs); i++)
            mr_release((MemoryRegion *)PyList_GET_ITEM(self->mrs, i));
        Py_CLEAR(self->mrs);
    }
    if (self->scratch_mr) { ibv_dereg_mr(self->scratch_mr); self->scratch_mr = NULL; }
    if (self->cq) { ibv_destroy_cq(self->cq); self->cq = NULL; }
    if (self->channel) { ibv_destroy_comp_channel(self->channel); self->channel = NULL; }
    if (self->pd) { ibv_dealloc_pd(self->pd); self->pd = NULL; }
    if (self->ctx) { ibv_close_device(self->ctx); self->ctx = NULL; }
    if (self->wake_fd >= 0) { close(self->wake_fd); self->wake_fd = -1; }
    if (self->nudge_fd >= 0) { close(self->nudge_fd); self->nudge_fd = -1; }
    free(self->scratch);
    self->scratch = NULL;
    Py_CLEAR(self->on_owed);
}

static PyObject *ep_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    Endpoint *self = (Endpoint *)type->tp_alloc(type, 0);
    if (self)
        self->wake_fd = self->nudge_fd = -1;
    return (PyObject *)self;
}

static void ep_dealloc(Endpoint *self)
{
    ep_release(self);
    Py_CLEAR(self->on_owed);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static struct ibv_context *open_device(const char *name)
{
    int n = 0;
    struct ibv_device **list = ibv_get_device_list(&n);
    struct ibv_context *ctx = NULL;
    if (!list || n == 0) {
        if (list)
            ibv_free_device_list(list);
        PyErr_Format(DeviceError, "no RDMA device: ibv_get_device_list found none (looking for %s)", name);
        return NULL;
    }
    char found[512] = "";
    for (int i = 0; i < n; i++) {
        const char *dev = ibv_get_device_name(list[i]);
        if (strcmp(dev, name) == 0) {
            ctx = ibv_open_device(list[i]);
            if (!ctx)
                PyErr_Format(DeviceError, "cannot open RDMA device %s: %s", name, strerror(errno));
            ibv_free_device_list(list);
            return ctx;
        }
        if (strlen(found) + strlen(dev) + 3 < sizeof found) {
            if (i)
                strcat(found, ", ");
            strcat(found, dev);
        }
    }
    ibv_free_device_list(list);
    PyErr_Format(DeviceError, "no RDMA device named %s (found %s)", name, found);
    return NULL;
}

static int ep_init(Endpoint *self, PyObject *args, PyObject *kw)
{
    static char *names[] = {"device", "port", "gid_index", "depth", "recv_depth", "psn", "pkey_index", NULL};
    const char *device;
    int port = 1, gid_index = 0, depth = 256, recv_depth = 256, pkey_index = 0;
    unsigned int psn = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "s|iiiiIi", names, &device, &port, &gid_index, &depth,
                                     &recv_depth, &psn, &pkey_index))
        return -1;
    if (pkey_index < 0 || pkey_index > 0xffff) {
        PyErr_Format(UsageError, "bad P_Key index %d", pkey_index);
        return -1;
    }
    if (self->ctx || self->closed) {
        PyErr_SetString(UsageError, "an Endpoint is initialized once");
        return -1;
    }
    if (port < 1 || port > 255 || gid_index < 0 || depth < 1 || recv_depth < RECV_BATCH) {
        PyErr_Format(UsageError, "bad endpoint parameters: port %d, gid index %d, depth %d, receive depth %d "
                     "(at least %d)", port, gid_index, depth, recv_depth, RECV_BATCH);
        return -1;
    }
    snprintf(self->device, sizeof self->device, "%s", device);
    self->port = port;
    self->gid_index = gid_index;
    self->psn = psn & 0xffffff;
    if (!(self->mrs = PyList_New(0)))
        return -1;

    if (!(self->ctx = open_device(device)))
        goto fail;
    struct ibv_port_attr pattr;
    int rc = ibv_query_port(self->ctx, port, &pattr);
    if (rc) {
        PyErr_Format(DeviceError, "%s has no port %d: %s", device, port, strerror(rc));
        goto fail;
    }
    if (pattr.state != IBV_PORT_ACTIVE) {
        PyErr_Format(DeviceError, "%s port %d is not ACTIVE (state %d)", device, port, (int)pattr.state);
        goto fail;
    }
    self->active_mtu = pattr.active_mtu;
    if ((rc = ibv_query_gid(self->ctx, port, gid_index, &self->gid))) {
        PyErr_Format(DeviceError, "%s port %d has no GID %d: %s", device, port, gid_index, strerror(rc ? rc : errno));
        goto fail;
    }
    struct ibv_device_attr dattr;
    if ((rc = ibv_query_device(self->ctx, &dattr))) {
        verbs_error("ibv_query_device", rc);
        goto fail;
    }
    self->depth = depth < dattr.max_qp_wr ? depth : dattr.max_qp_wr;
    self->recv_depth = recv_depth < dattr.max_qp_wr ? recv_depth : dattr.max_qp_wr;

    if (!(self->pd = ibv_alloc_pd(self->ctx))) {
        verbs_error("ibv_alloc_pd", errno);
        goto fail;
    }
    if (!(self->channel = ibv_create_comp_channel(self->ctx))) {
        verbs_error("ibv_create_comp_channel", errno);
        goto fail;
    }
    /* Non-blocking: of several threads woken by one event, the losers find none. */
    int flags = fcntl(self->channel->fd, F_GETFL);
    if (flags < 0 || fcntl(self->channel->fd, F_SETFL, flags | O_NONBLOCK) < 0) {
        verbs_error("making the completion channel non-blocking", errno);
        goto fail;
    }
    if ((self->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) < 0
        || (self->nudge_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) < 0) {
        verbs_error("eventfd", errno);
        goto fail;
    }
    int cqe = self->depth + self->recv_depth;
    if (cqe > dattr.max_cqe)
        cqe = dattr.max_cqe;
    if (!(self->cq = ibv_create_cq(self->ctx, cqe, NULL, self->channel, 0))) {
        verbs_error("ibv_create_cq", errno);
        goto fail;
    }
    if ((rc = ibv_req_notify_cq(self->cq, 0))) {
        verbs_error("ibv_req_notify_cq", rc);
        goto fail;
    }
    struct ibv_qp_init_attr init = {
        .send_cq = self->cq, .recv_cq = self->cq, .qp_type = IBV_QPT_RC, .sq_sig_all = 1,
        .cap = {.max_send_wr = self->depth, .max_recv_wr = self->recv_depth,
                .max_send_sge = 1, .max_recv_sge = 1, .max_inline_data = INLINE_WANTED},
    };
    if (!(self->qp = ibv_create_qp(self->pd, &init))) {
        init.cap.max_inline_data = 0;          /* a device without inline data */
        if (!(self->qp = ibv_create_qp(self->pd, &init))) {
            verbs_error("ibv_create_qp", errno);
            goto fail;
        }
    }
    self->max_inline = init.cap.max_inline_data;
    /* INIT now, so receives can be posted before the peer is known. */
    struct ibv_qp_attr attr = {.qp_state = IBV_QPS_INIT, .pkey_index = (uint16_t)pkey_index, .port_num = (uint8_t)port,
                               .qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE};
    if ((rc = ibv_modify_qp(self->qp, &attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))) {
        verbs_error("moving the queue pair to INIT", rc);
        goto fail;
    }
    if (posix_memalign(&self->scratch, 4096, 4096)) {
        PyErr_NoMemory();
        goto fail;
    }
    memset(self->scratch, 0, 4096);
    if (!(self->scratch_mr = ibv_reg_mr(self->pd, self->scratch, SCRATCH_BYTES, IBV_ACCESS_LOCAL_WRITE))) {
        verbs_error("registering the receive scratch buffer", errno);
        goto fail;
    }
    /* The receive batch: built once, chained, every one into the shared scratch. */
    for (int i = 0; i < RECV_BATCH; i++) {
        self->recv_sges[i] = (struct ibv_sge){.addr = (uintptr_t)self->scratch, .length = SCRATCH_BYTES,
                                              .lkey = self->scratch_mr->lkey};
        self->recv_wrs[i] = (struct ibv_recv_wr){.wr_id = RECV_TAG, .sg_list = &self->recv_sges[i], .num_sge = 1,
                                                 .next = i + 1 < RECV_BATCH ? &self->recv_wrs[i + 1] : NULL};
    }
    return 0;
fail:
    ep_release(self);
    return -1;
}

/* -- memory ------------------------------------------------------------ */

static PyObject *ep_register(Endpoint *self, PyObject *args, PyObject *kw)
{
    static char *names[] = {"buffer", "access", NULL};
    PyObject *obj;
    int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|i", names, &obj, &access) || check_open(self))
        return NULL;
    MemoryRegion *mr = PyObject_New(MemoryRegion, &MemoryRegionType);
    if (!mr)
        return NULL;
    mr->mr = NULL;
    mr->has_view = 0;
    /* memory the NIC only reads (no access flag) may be read-only here too */
    int writes = access & (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    if (PyObject_GetBuffer(obj, &mr->view, (writes ? PyBUF_WRITABLE : 0) | PyBUF_C_CONTIGUOUS) < 0) {
        Py_DECREF(mr);
        PyErr_Clear();
        PyErr_SetString(UsageError, writes ? "only writable C-contiguous memory can be registered for writes"
                                           : "only C-contiguous memory can be registered");
        return NULL;
    }
    mr->has_view = 1;
    if (mr->view.len <= 0 || (uint64_t)mr->view.len > MAX_REGION) {
        PyErr_Format(UsageError, "a region must hold 1 byte to 4 GiB, not %zd", mr->view.len);
        Py_DECREF(mr);
        return NULL;
    }
    mr->mr = ibv_reg_mr(self->pd, mr->view.buf, mr->view.len, access);
    if (!mr->mr) {
        int err = errno;
        Py_ssize_t len = mr->view.len;
        Py_DECREF(mr);
        PyErr_Format(VerbsError, "registering %zd bytes failed: %s (errno %d)", len, strerror(err), err);
        return NULL;
    }
    mr->addr = (uintptr_t)mr->view.buf;
    mr->length = mr->view.len;
    mr->lkey = mr->mr->lkey;
    mr->rkey = mr->mr->rkey;
    mr->access = access;
    if (PyList_Append(self->mrs, (PyObject *)mr) < 0) {
        Py_DECREF(mr);
        return NULL;
    }
    return (PyObject *)mr;
}

static PyObject *ep_deregister(Endpoint *self, PyObject *arg)
{
    if (!PyObject_TypeCheck(arg, &MemoryRegionType)) {
        PyErr_SetString(PyExc_TypeError, "deregister() takes a MemoryRegion of this endpoint");
        return NULL;
    }
    if (self->mrs) {
        Py_ssize_t n = PyList_GET_SIZE(self->mrs);
        for (Py_ssize_t i = 0; i < n; i++) {
            if (PyList_GET_ITEM(self->mrs, i) == arg) {
                mr_release((MemoryRegion *)arg);
                if (PySequence_DelItem(self->mrs, i) < 0)
                    return NULL;
                self->last_source = 0;
                break;
            }
        }
    }
    Py_RETURN_NONE;
}

/* The local-only region holding [addr, addr + len), or NULL with TransportError set. */
static MemoryRegion *find_source(Endpoint *self, uint64_t addr, uint64_t len)
{
    Py_ssize_t n = PyList_GET_SIZE(self->mrs);
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_ssize_t i = (self->last_source + k) % n;
        MemoryRegion *mr = (MemoryRegion *)PyList_GET_ITEM(self->mrs, i);
        if (!(mr->access & IBV_ACCESS_REMOTE_WRITE) && mr->addr <= addr && addr + len <= mr->addr + mr->length) {
            self->last_source = i;
            return mr;
        }
    }
    PyErr_Format(TransportError, "verbs sends only from registered staging memory: [%p, +%llu) is in no "
                 "local-only region of this endpoint", (void *)(uintptr_t)addr, (unsigned long long)len);
    return NULL;
}

/* -- connection -------------------------------------------------------- */

static PyObject *ep_connect_qp(Endpoint *self, PyObject *args)
{
    unsigned int qpn, psn;
    int mtu, is_global = 1, dlid = 0, sl = 0, hop_limit = 64, traffic_class = 0, timeout = 14, retry_cnt = 7;
    Py_buffer gid;
    /* the route (addressing.py's Route): a GRH to the GID, or on InfiniBand the LID alone */
    if (!PyArg_ParseTuple(args, "IIy*i|iiiiiii", &qpn, &psn, &gid, &mtu, &is_global, &dlid, &sl, &hop_limit,
                          &traffic_class, &timeout, &retry_cnt))
        return NULL;
    if (check_open(self)) {
        PyBuffer_Release(&gid);
        return NULL;
    }
    if (gid.len != 16 || mtu < IBV_MTU_256 || mtu > IBV_MTU_4096 || dlid < 0 || dlid > 0xffff || sl < 0 ||
        sl > 15 || hop_limit < 0 || hop_limit > 255 || traffic_class < 0 || traffic_class > 255 || timeout < 0 ||
        timeout > 31 || retry_cnt < 0 || retry_cnt > 7) {
        PyBuffer_Release(&gid);
        PyErr_Format(TransportError, "unusable route: a %zd-byte GID, MTU enum %d, LID %d, SL %d, hop limit %d, "
                     "traffic class %d, timeout %d, retries %d", gid.len, mtu, dlid, sl, hop_limit, traffic_class,
                     timeout, retry_cnt);
        return NULL;
    }
    struct ibv_qp_attr attr = {
        .qp_state = IBV_QPS_RTR, .path_mtu = mtu, .dest_qp_num = qpn & 0xffffff, .rq_psn = psn & 0xffffff,
        .max_dest_rd_atomic = 1, .min_rnr_timer = 12,
        .ah_attr = {.is_global = is_global ? 1 : 0, .dlid = (uint16_t)dlid, .sl = (uint8_t)sl,
                    .port_num = (uint8_t)self->port,
                    .grh = {.sgid_index = (uint8_t)self->gid_index, .hop_limit = (uint8_t)hop_limit,
                            .traffic_class = (uint8_t)traffic_class}},
    };
    if (is_global)
        memcpy(attr.ah_attr.grh.dgid.raw, gid.buf, 16);
    PyBuffer_Release(&gid);
    int rc = ibv_modify_qp(self->qp, &attr, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                           IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
    if (rc) {
        PyErr_Format(VerbsError, "connecting QP %u to remote QP %u: moving to RTR failed: %s (errno %d)",
                     self->qp->qp_num, qpn, strerror(rc), rc);
        return NULL;
    }
    struct ibv_qp_attr rts = {
        .qp_state = IBV_QPS_RTS, .sq_psn = self->psn, .max_rd_atomic = 1,
        .timeout = (uint8_t)timeout,      /* 4.096 us * 2^timeout per try (14: 67 ms) */
        .retry_cnt = (uint8_t)retry_cnt,
        .rnr_retry = 7,         /* infinite: the receiver re-posts receives as it consumes them */
    };
    rc = ibv_modify_qp(self->qp, &rts, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                       IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
    if (rc) {
        PyErr_Format(VerbsError, "connecting QP %u to remote QP %u: moving to RTS failed: %s (errno %d)",
                     self->qp->qp_num, qpn, strerror(rc), rc);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* -- data path --------------------------------------------------------- */

/* A tag-0 DATA immediate and a CREDIT as one PAIR immediate (contract.py's
 * pair_imm); 0 when they cannot pair (no PAIR immediate is 0). */
static uint32_t pair_imm(uint32_t data, uint32_t credit)
{
    uint32_t index = credit & ((1u << 30) - 1);
    if (data >> PAIR_BITS || credit >> 30 != IMM_CREDIT || index >> PAIR_BITS)
        return 0;
    return IMM_PAIR << 30 | index << PAIR_BITS | data;
}

/* Owed credits ride in the writes' immediates where they pair, the last owed
 * first: how many did (they stay owed until the chain is posted). */
static int pair_owed(Endpoint *self, struct ibv_send_wr *writes, int n)
{
    int paired = 0;
    for (int i = 0; i < n && paired < self->n_owed; i++) {
        if (writes[i].opcode != IBV_WR_RDMA_WRITE_WITH_IMM)
            continue;
        uint32_t both = pair_imm(writes[i].imm_data, self->owed[self->n_owed - 1 - paired]);
        if (both) {
            writes[i].imm_data = both;
            paired++;
        }
    }
    return paired;
}

/* The first `count` owed immediates as SEND WITH IMM work requests at the head
 * of a chain: they go with the next doorbell instead of one each. */
static int owed_chain(Endpoint *self, struct ibv_send_wr *wrs, int count)
{
    for (int i = 0; i < count; i++)
        wrs[i] = (struct ibv_send_wr){.opcode = IBV_WR_SEND_WITH_IMM, .send_flags = IBV_SEND_SIGNALED,
                                      .imm_data = self->owed[i]};
    return count;
}

#define POST_FAILED UINT64_MAX            /* post_chain(): the error is set */

/* Post wrs[0..n) as one chain (one doorbell), numbered in order; the first's
 * number, 0 when the send queue lacks room for all of them (nothing posted).
 * With `owed` set, the chain carries every owed immediate (leading it, or
 * paired): posted, they are no longer owed. */
static uint64_t post_chain(Endpoint *self, struct ibv_send_wr *wrs, int n, int owed, const char *what)
{
    if (self->sends_posted - self->sends_completed + (uint64_t)n > (uint64_t)self->depth)
        return 0;
    for (int i = 0; i < n; i++) {
        wrs[i].wr_id = self->sends_posted + 1 + (uint64_t)i;
        wrs[i].next = i + 1 < n ? &wrs[i + 1] : NULL;
    }
    struct ibv_send_wr *bad = NULL;
    int rc = ibv_post_send(self->qp, wrs, &bad);
    if (owed)
        self->n_owed = 0;             /* posted, or the queue pair failed and no credit matters any more */
    if (rc) {
        self->sends_posted += bad ? (uint64_t)(bad - wrs) : 0;   /* those before the bad one went */
        verbs_error(what, rc);
        return POST_FAILED;
    }
    uint64_t first = self->sends_posted + 1;
    self->sends_posted += (uint64_t)n;
    return first;
}

/* The owed immediates alone, as post_chain() (1 when none are owed). */
static uint64_t post_owed_chain(Endpoint *self)
{
    struct ibv_send_wr wrs[MAX_CHAIN];
    int n = owed_chain(self, wrs, self->n_owed);
    return n ? post_chain(self, wrs, n, 1, "posting owed immediates") : 1;
}

/* Post one numbered send, after the owed immediates (one may ride in it); its
 * number, 0 when the send queue is full. */
static PyObject *post_numbered(Endpoint *self, struct ibv_send_wr *wr, const char *what)
{
    struct ibv_send_wr wrs[MAX_CHAIN + 1];
    int owed = self->n_owed;
    int credits = owed_chain(self, wrs, owed - pair_owed(self, wr, 1));
    wrs[credits] = *wr;
    uint64_t first = post_chain(self, wrs, credits + 1, owed, what);
    if (first == POST_FAILED)
        return NULL;
    return PyLong_FromUnsignedLongLong(first ? first + (uint64_t)credits : 0);
}

static int parse_imm(PyObject *obj, uint32_t *imm)
{
    unsigned long v = PyLong_AsUnsignedLong(obj);
    if (v == (unsigned long)-1 && PyErr_Occurred())
        return -1;
    if (v > 0xffffffffUL) {
        PyErr_Format(UsageError, "an immediate is 32 bits, not %lu", v);
        return -1;
    }
    *imm = (uint32_t)v;
    return 0;
}

/* Fill one write's work request and SGE: bounds and source checked, nothing posted. */
static int build_write(Endpoint *self, PyObject *src, unsigned long long raddr, Py_ssize_t rlength,
                       unsigned int rkey, Py_ssize_t offset, PyObject *imm_obj,
                       struct ibv_send_wr *wr, struct ibv_sge *sge, MemoryRegion **source)
{
    Py_buffer view;
    if (PyObject_GetBuffer(src, &view, PyBUF_SIMPLE) < 0)
        return -1;
    uint64_t addr = (uintptr_t)view.buf, length = view.len;
    PyBuffer_Release(&view);          /* the memory region keeps the memory alive */
    if (offset < 0 || rlength < 0 || (uint64_t)offset + length > (uint64_t)rlength) {
        PyErr_Format(TransportError, "write of %llu bytes at offset %zd is outside the %zd-byte remote region",
                     (unsigned long long)length, offset, rlength);
        return -1;
    }
    *sge = (struct ibv_sge){.addr = addr, .length = (uint32_t)length};
    *wr = (struct ibv_send_wr){.sg_list = sge, .num_sge = length ? 1 : 0, .opcode = IBV_WR_RDMA_WRITE,
                               .send_flags = IBV_SEND_SIGNALED};
    wr->wr.rdma.remote_addr = raddr + (uint64_t)offset;
    wr->wr.rdma.rkey = rkey;
    if (length) {
        MemoryRegion *mr = find_source(self, addr, length);
        if (!mr)
            return -1;
        if (source)
            *source = mr;
        sge->lkey = mr->lkey;
        if (length <= self->max_inline)
            wr->send_flags |= IBV_SEND_INLINE;
    }
    if (imm_obj != Py_None) {
        if (parse_imm(imm_obj, &wr->imm_data) < 0)
            return -1;
        wr->opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
    }
    return 0;
}

/* (src, remote, remote_offset, imm=None), as post_write() and prepare_write()
 * take them, into a checked work request; `*src` is borrowed. */
static int parse_write(Endpoint *self, PyObject *args, PyObject *kw, PyObject **src,
                       struct ibv_send_wr *wr, struct ibv_sge *sge, MemoryRegion **source)
{
    static char *names[] = {"src", "remote", "remote_offset", "imm", NULL};
    PyObject *imm_obj = Py_None;
    unsigned long long raddr;
    Py_ssize_t rlength, offset;
    unsigned int rkey;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O(KnI)n|O", names, src, &raddr, &rlength, &rkey, &offset,
                                     &imm_obj) || check_open(self))
        return -1;
    return build_write(self, *src, raddr, rlength, rkey, offset, imm_obj, wr, sge, source);
}

static PyObject *ep_post_write(Endpoint *self, PyObject *args, PyObject *kw)
{
    PyObject *src;
    struct ibv_sge sge;
    struct ibv_send_wr wr;
    if (parse_write(self, args, kw, &src, &wr, &sge, NULL) < 0)
        return NULL;
    return post_numbered(self, &wr, "posting a write");
}

/* -- prepared writes ---------------------------------------------------- */

/* One write built and checked once, posted by calling it: a static tensor's
 * staging to its slot, the session's most frequent call. Posting it parses,
 * looks up and checks nothing: on SoftRoCE under emulation that is a good part
 * of a small write's cost. It posts nothing and returns 0, for the caller to
 * take the checked path, while the endpoint is halted or closed, its source is
 * deregistered, or the send queue is full. */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    Endpoint *ep;
    PyObject *src;                         /* kept alive: the memory the write reads */
    MemoryRegion *source;                  /* the write's lkey is this region's */
    struct ibv_send_wr wr;
    struct ibv_sge sge;
} PreparedWrite;

static PyTypeObject PreparedWriteType;

static PyObject *prepared_vectorcall(PreparedWrite *self, PyObject *const *args, size_t nargsf, PyObject *kw)
{
    if (PyVectorcall_NARGS(nargsf) || kw) {
        PyErr_SetString(PyExc_TypeError, "a prepared write takes no arguments");
        return NULL;
    }
    Endpoint *ep = self->ep;
    if (ep->halted || ep->closed || ep->closing || !self->source->mr)
        return PyLong_FromLong(0);
    struct ibv_send_wr wr = self->wr;      /* an owed credit may pair into this copy's immediate */
    return post_numbered(ep, &wr, "posting a write");
}

static int prepared_traverse(PreparedWrite *self, visitproc visit, void *arg)
{
    Py_VISIT(self->ep);
    Py_VISIT(self->src);
    Py_VISIT(self->source);
    return 0;
}

static int prepared_clear(PreparedWrite *self)
{
    Py_CLEAR(self->ep);
    Py_CLEAR(self->src);
    Py_CLEAR(self->source);
    return 0;
}

static void prepared_dealloc(PreparedWrite *self)
{
    PyObject_GC_UnTrack(self);
    prepared_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject PreparedWriteType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "rdmatensor.providers.verbs._native_endpoint.PreparedWrite",
    .tp_doc = "Endpoint.prepare_write(...)(): post the write; its send number, 0 if it did not post",
    .tp_basicsize = sizeof(PreparedWrite),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(PreparedWrite, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_traverse = (traverseproc)prepared_traverse,
    .tp_clear = (inquiry)prepared_clear,
    .tp_dealloc = (destructor)prepared_dealloc,
};

static PyObject *ep_prepare_write(Endpoint *self, PyObject *args, PyObject *kw)
{
    PreparedWrite *p = PyObject_GC_New(PreparedWrite, &PreparedWriteType);
    if (!p)
        return NULL;
    p->vectorcall = (vectorcallfunc)prepared_vectorcall;
    p->ep = NULL;
    p->src = NULL;
    p->source = NULL;
    PyObject *src;
    if (parse_write(self, args, kw, &src, &p->wr, &p->sge, &p->source) < 0) {
        p->source = NULL;
        Py_DECREF(p);
        return NULL;
    }
    if (!p->source) {
        Py_DECREF(p);
        PyErr_SetString(UsageError, "a prepared write has bytes to write");
        return NULL;
    }
    p->wr.sg_list = &p->sge;
    Py_INCREF(self);
    p->ep = self;
    Py_INCREF(src);
    p->src = src;
    Py_INCREF(p->source);
    PyObject_GC_Track(p);
    return (PyObject *)p;
}

/* Several writes as one chain of work requests: one doorbell. Every one is
 * checked before any is posted; numbered in order; 0 if the queue lacks room. */
static PyObject *ep_post_writes(Endpoint *self, PyObject *arg)
{
    if (check_open(self))
        return NULL;
    PyObject *seq = PySequence_Fast(arg, "post_writes takes a list of (src, remote, offset, imm)");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n < 1 || n > MAX_CHAIN) {
        Py_DECREF(seq);
        PyErr_Format(UsageError, "post_writes takes 1 to %d writes, not %zd", MAX_CHAIN, n);
        return NULL;
    }
    struct ibv_sge sges[MAX_CHAIN];
    struct ibv_send_wr writes[MAX_CHAIN], wrs[2 * MAX_CHAIN];
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *src, *imm_obj;
        unsigned long long raddr;
        Py_ssize_t rlength, offset;
        unsigned int rkey;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "O(KnI)nO;a write is (src, remote, offset, imm)",
                              &src, &raddr, &rlength, &rkey, &offset, &imm_obj) ||
            build_write(self, src, raddr, rlength, rkey, offset, imm_obj, &writes[i], &sges[i], NULL) < 0) {
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    int owed = self->n_owed;
    int credits = owed_chain(self, wrs, owed - pair_owed(self, writes, (int)n));
    memcpy(&wrs[credits], writes, (size_t)n * sizeof writes[0]);
    uint64_t first = post_chain(self, wrs, credits + (int)n, owed, "posting a chain of writes");
    if (first == POST_FAILED)
        return NULL;
    return PyLong_FromUnsignedLongLong(first ? first + (uint64_t)credits : 0);     /* the first write's */
}

/* An immediate (a credit) that may wait for the next chain: taken only while
 * `deferring` is set; when MAX_CHAIN are owed, they are posted first. False:
 * not taken (post it yourself). */
static PyObject *ep_owe(Endpoint *self, PyObject *arg)
{
    uint32_t imm;
    if (check_open(self) || parse_imm(arg, &imm) < 0)
        return NULL;
    if (!self->deferring)
        Py_RETURN_FALSE;
    if (self->n_owed == MAX_CHAIN) {
        uint64_t first = post_owed_chain(self);
        if (first == POST_FAILED)
            return NULL;
        if (!first)
            Py_RETURN_FALSE;
    }
    self->owed[self->n_owed++] = imm;
    PyObject *wake = self->on_owed;        /* the background thread parked until a credit is owed */
    if (wake) {
        self->on_owed = NULL;
        PyObject *r = PyObject_CallNoArgs(wake);
        Py_DECREF(wake);
        if (!r)
            return NULL;
        Py_DECREF(r);
    }
    Py_RETURN_TRUE;
}

/* Post the owed immediates now (one doorbell): True when none remain owed,
 * False when the send queue lacks room for them. */
static PyObject *ep_post_owed(Endpoint *self, PyObject *unused)
{
    if (check_open(self))
        return NULL;
    uint64_t first = post_owed_chain(self);
    if (first == POST_FAILED)
        return NULL;
    return PyBool_FromLong(first != 0);
}

static PyObject *ep_post_send_imm(Endpoint *self, PyObject *arg)
{
    if (check_open(self))
        return NULL;
    struct ibv_send_wr wr = {.num_sge = 0, .opcode = IBV_WR_SEND_WITH_IMM, .send_flags = IBV_SEND_SIGNALED};
    if (parse_imm(arg, &wr.imm_data) < 0)
        return NULL;
    return post_numbered(self, &wr, "posting an immediate");
}

static PyObject *ep_post_send(Endpoint *self, PyObject *src)
{
    if (check_open(self))
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(src, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    uint64_t addr = (uintptr_t)view.buf, length = view.len;
    PyBuffer_Release(&view);
    struct ibv_sge sge = {.addr = addr, .length = (uint32_t)length};
    struct ibv_send_wr wr = {.sg_list = &sge, .num_sge = length ? 1 : 0, .opcode = IBV_WR_SEND,
                             .send_flags = IBV_SEND_SIGNALED};
    if (length) {
        MemoryRegion *mr = find_source(self, addr, length);
        if (!mr)
            return NULL;
        sge.lkey = mr->lkey;
    }
    return post_numbered(self, &wr, "posting a send");
}

/* Give back `count` consumed receives, posted in chained batches of RECV_BATCH. */
static int give_back_receives(Endpoint *self, int count)
{
    self->recv_owed += count;
    while (self->recv_owed >= RECV_BATCH) {
        struct ibv_recv_wr *bad = NULL;
        int rc = ibv_post_recv(self->qp, &self->recv_wrs[0], &bad);
        if (rc) {
            verbs_error("posting receives", rc);
            return -1;
        }
        self->recv_owed -= RECV_BATCH;
    }
    return 0;
}

static PyObject *ep_post_recv(Endpoint *self, PyObject *args)
{
    int count = 1;
    if (!PyArg_ParseTuple(args, "|i", &count) || check_open(self))
        return NULL;
    if (count < 0) {
        PyErr_SetString(UsageError, "post_recv() takes a count of 0 or more");
        return NULL;
    }
    if (give_back_receives(self, count) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *ep_post_recv_into(Endpoint *self, PyObject *args)
{
    PyObject *dst;
    unsigned long long recv_id;
    if (!PyArg_ParseTuple(args, "OK", &dst, &recv_id) || check_open(self))
        return NULL;
    if (recv_id & RECV_TAG) {
        PyErr_SetString(UsageError, "a receive's id must be below 2**63");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(dst, &view, PyBUF_WRITABLE) < 0)
        return NULL;
    uint64_t addr = (uintptr_t)view.buf, length = view.len;
    PyBuffer_Release(&view);
    MemoryRegion *mr = find_source(self, addr, length);
    if (!mr)
        return NULL;
    struct ibv_sge sge = {.addr = addr, .length = (uint32_t)length, .lkey = mr->lkey};
    struct ibv_recv_wr wr = {.wr_id = RECV_TAG | recv_id, .sg_list = &sge, .num_sge = 1};
    struct ibv_recv_wr *bad = NULL;
    int rc = ibv_post_recv(self->qp, &wr, &bad);
    if (rc)
        return verbs_error("posting a receive", rc);
    Py_RETURN_NONE;
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Up to max_entries completions into wc; with `spin`, polls up to that many
 * seconds with the GIL released until something completes. -1: poll failed. */
static int poll_completions(Endpoint *self, struct ibv_wc *wc, int max_entries, double spin)
{
    int n = ibv_poll_cq(self->cq, max_entries, wc);
    if (n == 0 && spin > 0) {
        __atomic_add_fetch(&self->busy, 1, __ATOMIC_ACQ_REL);
        Py_BEGIN_ALLOW_THREADS
        double deadline = now() + spin;
        int i = 0;
        while ((n = ibv_poll_cq(self->cq, max_entries, wc)) == 0 && !__atomic_load_n(&self->closing, __ATOMIC_ACQUIRE))
            if ((++i & 63) == 0 && now() > deadline)
                break;
        Py_END_ALLOW_THREADS
        __atomic_sub_fetch(&self->busy, 1, __ATOMIC_ACQ_REL);
    }
    if (n < 0)
        PyErr_SetString(VerbsError, "polling the completion queue failed");
    for (int i = 0; i < n; i++)
        if (!(wc[i].wr_id & RECV_TAG))
            self->sends_completed++;
        else if (wc[i].status == IBV_WC_SUCCESS)
            self->arrivals++;
    return n;
}

/* Completed work as (wr_id, status, is_receive, imm, byte_len) tuples: a
 * receive's own id without the tag, a send's number. With `spin`, polls up
 * to that many seconds with the GIL released until something completes. */
static PyObject *ep_poll(Endpoint *self, PyObject *args, PyObject *kw)
{
    static char *names[] = {"max_entries", "spin", NULL};
    int max_entries = 32;
    double spin = 0.0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|id", names, &max_entries, &spin) || check_open(self))
        return NULL;
    if (max_entries < 1)
        max_entries = 1;
    if (max_entries > MAX_POLL)
        max_entries = MAX_POLL;
    struct ibv_wc wc[MAX_POLL];
    int n = poll_completions(self, wc, max_entries, spin);
    if (n < 0)
        return NULL;
    PyObject *out = PyList_New(n);
    if (!out)
        return NULL;
    for (int i = 0; i < n; i++) {
        int is_recv = (wc[i].wr_id & RECV_TAG) != 0;
        PyObject *t = Py_BuildValue("(KiNII)", (unsigned long long)(wc[i].wr_id & ~RECV_TAG), (int)wc[i].status,
                                    PyBool_FromLong(is_recv), (unsigned int)wc[i].imm_data, (unsigned int)wc[i].byte_len);
        if (!t) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, t);
    }
    return out;
}

/* The work on n completions, in order, up to the first failed one: a receive
 * given back and its immediate passed to on_imm(imm); `*last` the last send
 * number completed well; `*failed` (wr_id, status, is_receive) of a failed
 * one, else left NULL. -1 with an error set when on_imm or a post fails. */
static int take_completions(Endpoint *self, struct ibv_wc *wc, int n, PyObject *on_imm, unsigned long long *last,
                            PyObject **failed)
{
    for (int i = 0; i < n; i++) {
        int is_recv = (wc[i].wr_id & RECV_TAG) != 0;
        if (wc[i].status != IBV_WC_SUCCESS) {
            *failed = Py_BuildValue("(KiN)", (unsigned long long)(wc[i].wr_id & ~RECV_TAG), (int)wc[i].status,
                                    PyBool_FromLong(is_recv));
            return *failed ? 0 : -1;
        }
        if (!is_recv) {
            *last = wc[i].wr_id;
            continue;
        }
        if (give_back_receives(self, 1) < 0)
            return -1;
        PyObject *imm = PyLong_FromUnsignedLong(wc[i].imm_data);
        PyObject *r = imm ? PyObject_CallOneArg(on_imm, imm) : NULL;
        Py_XDECREF(imm);
        if (!r)
            return -1;
        Py_DECREF(r);
    }
    return 0;
}

/* poll() and the work on what it found, in one call: every receive given
 * back and its immediate passed to on_imm(imm), in order, up to the first
 * failed completion. (found, the last send number completed well, failed:
 * None or (wr_id, status, is_receive)). */
static PyObject *ep_reap(Endpoint *self, PyObject *args)
{
    PyObject *on_imm;
    double spin = 0.0;
    if (!PyArg_ParseTuple(args, "O|d", &on_imm, &spin) || check_open(self))
        return NULL;
    struct ibv_wc wc[32];
    int n = poll_completions(self, wc, 32, spin);
    if (n < 0)
        return NULL;
    unsigned long long last = 0;
    PyObject *failed = NULL;
    if (take_completions(self, wc, n, on_imm, &last, &failed) < 0)
        return NULL;
    if (failed)
        return Py_BuildValue("(iKN)", n, last, failed);
    return Py_BuildValue("(iKO)", n, last, Py_None);
}

/* -- the waiter ----------------------------------------------------------- */

/* A thread's wait for a flag (a value's arrival, a credit) on this endpoint,
 * whole in C: verbs.py's VerbsChannel.wait_for() spin, for the session's
 * compiled hop (session/_slots.c). Calling it, w(flag, limit=None), polls the CQ as the
 * channel's _reap() does (under its poll lock, the channel's _sent and
 * _polled_at kept, sleepers on sends woken, a failure handed to the
 * channel's _reap_failed()), until flag.is_set() or its spin (at most `limit`
 * seconds) passed.
 * With the channel's event lock, once the spin passed it sleeps on the
 * completion channel itself, up to `sleep` seconds: the completion that sets
 * the flag wakes this thread alone, where handing it over from the
 * background thread takes several wake-ups. On SoftRoCE the NIC is the
 * kernel, so CPU spent spinning or handing over is the NIC's.
 * True: the flag is set. None: it is not, or this thread may not poll now
 * (another reaps, the channel is halted or closing, credits are owed that
 * find no room): take the channel's wait_for(), which decides and sleeps.
 * w(None) polls once, spinning not at all: a sender takes in its completions
 * and credits itself, so the background thread is not woken for each. */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    Endpoint *ep;
    PyObject *channel, *on_imm, *acquire, *release;
    PyObject *event_acquire, *event_release;   /* the channel's event lock, or NULL: never sleeps here */
    double spin;                           /* seconds polled before giving up, or sleeping here */
    double sleep;                          /* then seconds at most asleep on the completion channel */
} Waiter;

static PyTypeObject WaiterType;
static PyObject *is_set_name, *closing_name, *sent_name, *polled_at_name, *send_waiters_name, *wake_sends_name,
    *reap_failed_name;

static int flag_is_set(PyObject *flag)
{
    PyObject *r = PyObject_CallMethodNoArgs(flag, is_set_name);
    int set = r ? PyObject_IsTrue(r) : -1;
    Py_XDECREF(r);
    return set;
}

static int mark_polled(Waiter *self)      /* the channel's _polled_at: a waiter polls the CQ itself */
{
    PyObject *t = PyFloat_FromDouble(now());
    int rc = t ? PyObject_SetAttr(self->channel, polled_at_name, t) : -1;
    Py_XDECREF(t);
    return rc;
}

/* The channel's _sent, and whoever sleeps on a send woken. */
static int publish_sent(Waiter *self, unsigned long long last)
{
    PyObject *number = PyLong_FromUnsignedLongLong(last);
    int rc = number ? PyObject_SetAttr(self->channel, sent_name, number) : -1;
    Py_XDECREF(number);
    if (rc < 0)
        return -1;
    PyObject *waiters = PyObject_GetAttr(self->channel, send_waiters_name);
    int any = waiters ? PyObject_IsTrue(waiters) : -1;
    Py_XDECREF(waiters);
    if (any <= 0)
        return any;
    PyObject *r = PyObject_CallMethodNoArgs(self->channel, wake_sends_name);
    Py_XDECREF(r);
    return r ? 0 : -1;
}

/* A failure while reaping, as the channel's _reap() makes it: the exception
 * taken out of the error indicator. */
static PyObject *fetch_failure(void)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value ? value : Py_NewRef(Py_None);
}

/* After the spin, under the poll lock: sleep on the completion channel,
 * holding the channel's event lock (the background thread then keeps off
 * it), until the flag is set or `budget` seconds passed. Each wake-up takes
 * in what completed, as the spin does. 1: set, 0: not, -1: error set. */
static int sleep_for_flag(Waiter *self, PyObject *flag, double budget, unsigned long long *last, PyObject **failure)
{
    Endpoint *ep = self->ep;
    PyObject *got = PyObject_CallOneArg(self->event_acquire, Py_False);
    int set = got ? PyObject_IsTrue(got) : -1;
    Py_XDECREF(got);
    if (set == 0) {                        /* the background thread sleeps on the channel: end its wait */
        uint64_t one = 1;                  /* (one wait_event() at most: however starved of CPU it is,
                                            * it lets go before the budget, and this wait ends asleep) */
        if (write(ep->nudge_fd, &one, sizeof one) < 0) { /* full: it is being woken anyway */ }
        got = PyObject_CallFunction(self->event_acquire, "id", 1, budget);
        set = got ? PyObject_IsTrue(got) : -1;
        Py_XDECREF(got);
    }
    if (set == 0)                          /* still held: the holder hands the value over */
        ep->handed_over++;
    if (set <= 0)
        return set;
    set = 0;
    double deadline = now() + budget;
    unsigned long long published = *last;
    int armed = 0;                         /* an event taken leaves the CQ unarmed: armed again on the way out */
    while (!set && !*failure) {
        double left = deadline - now();
        if (left <= 0 || ep->halted || ep->closing || ep->closed)
            break;
        if (ep->n_owed) {                  /* the peer may be waiting for them */
            uint64_t first = post_owed_chain(ep);
            if (first == POST_FAILED)
                PyErr_Clear();             /* wait_for() posts them again and says what is wrong */
            if (!first || first == POST_FAILED)
                break;
        }
        int err = armed ? 0 : ibv_req_notify_cq(ep->cq, 0);
        if (err) {
            verbs_error("arming the completion queue", err);
            set = -1;
            break;
        }
        armed = 1;
        struct ibv_wc wc[32];
        int n = poll_completions(ep, wc, 32, 0);     /* what came before the CQ was armed */
        if (n == 0) {
            if (mark_polled(self) < 0) {               /* the background thread stays quiet */
                set = -1;
                break;
            }
            struct pollfd fds[2] = {{.fd = ep->channel->fd, .events = POLLIN},
                                    {.fd = ep->wake_fd, .events = POLLIN}};
            int ms = (int)((left < SLEEP_LOOK ? left : SLEEP_LOOK) * 1000 + 0.999), rc;
            __atomic_add_fetch(&ep->busy, 1, __ATOMIC_ACQ_REL);
            Py_BEGIN_ALLOW_THREADS
            rc = poll(fds, 2, ms);
            Py_END_ALLOW_THREADS
            __atomic_sub_fetch(&ep->busy, 1, __ATOMIC_ACQ_REL);
            if (ep->closing || ep->closed)
                break;
            if (rc > 0 && (fds[0].revents & POLLIN)) {
                struct ibv_cq *cq;
                void *cq_ctx;
                if (ibv_get_cq_event(ep->channel, &cq, &cq_ctx) == 0) {
                    ibv_ack_cq_events(cq, 1);
                    armed = 0;
                }                                       /* else another thread took it, and arms again */
            }
            n = poll_completions(ep, wc, 32, 0);
        }
        if (n < 0 || (n > 0 && take_completions(ep, wc, n, self->on_imm, last, failure) < 0)) {
            *failure = fetch_failure();
            break;
        }
        if (*last != published) {          /* a writer may wait for it: not until this sleep ends */
            published = *last;
            if (publish_sent(self, published) < 0) {
                set = -1;
                break;
            }
        }
        if (!*failure)
            set = flag_is_set(flag);
    }
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (!armed && !ep->closing && !ep->closed)
        ibv_req_notify_cq(ep->cq, 0);      /* the background thread sleeps on events next */
    if (set == 1)
        ep->woken_waiter++;
    PyObject *r = PyObject_CallNoArgs(self->event_release);
    Py_XDECREF(r);
    if (type)
        PyErr_Restore(type, value, tb);
    else if (!r)
        set = -1;
    return set;
}

static PyObject *waiter_vectorcall(Waiter *self, PyObject *const *args, size_t nargsf, PyObject *kw)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    double spin = self->spin, limit = INFINITY;
    if (nargs < 1 || nargs > 2 || kw) {
        PyErr_SetString(PyExc_TypeError, "waiter(flag, limit=None)");
        return NULL;
    }
    if (nargs == 2 && args[1] != Py_None) {   /* a caller's timeout shorter than the spin bounds it */
        limit = PyFloat_AsDouble(args[1]);
        if (limit == -1.0 && PyErr_Occurred())
            return NULL;
        if (limit < spin)
            spin = limit > 0 ? limit : 0;
    }
    double started = now();
    PyObject *flag = args[0];
    int once = flag == Py_None;            /* a sender's look at its completions */
    int set = once ? 0 : flag_is_set(flag);
    if (set)
        return set < 0 ? NULL : Py_NewRef(Py_True);
    if (once)
        spin = 0;
    Endpoint *ep = self->ep;
    if (ep->halted || ep->closed || ep->closing)
        Py_RETURN_NONE;
    if (ep->n_owed) {                      /* the peer may be waiting for them: they go first */
        uint64_t first = post_owed_chain(ep);
        if (first == POST_FAILED)
            PyErr_Clear();                 /* wait_for() posts them again and says what is wrong */
        if (!first || first == POST_FAILED)
            Py_RETURN_NONE;
    }
    /* Another thread reaping holds the poll lock for one poll: wait the spin for it, as the spin
     * would have. One that keeps it longer (a waiter asleep) hands the value over. */
    PyObject *got = spin > 0 ? PyObject_CallFunction(self->acquire, "id", 1, spin)
                             : PyObject_CallOneArg(self->acquire, Py_False);
    int locked = got ? PyObject_IsTrue(got) : -1;
    Py_XDECREF(got);
    if (locked == 0 && !once)
        ep->handed_over++;
    if (locked <= 0)
        return locked < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *result = NULL, *failure = NULL;
    unsigned long long last = 0;
    PyObject *closing = PyObject_GetAttr(self->channel, closing_name);
    int stop = closing ? PyObject_IsTrue(closing) : -1;
    Py_XDECREF(closing);
    if (stop < 0 || mark_polled(self) < 0)
        goto unlock;
    double deadline = now() + spin;
    while (!stop) {
        struct ibv_wc wc[32];
        double left = deadline - now();
        int n = ep->closing || ep->closed ? -2 : poll_completions(ep, wc, 32, left > 0 ? left : 0);
        if (n == -2)
            break;
        if (n < 0 || take_completions(ep, wc, n, self->on_imm, &last, &failure) < 0) {
            failure = fetch_failure();             /* the channel fails as _reap() makes it */
            break;
        }
        if (failure || once)
            break;
        if ((set = flag_is_set(flag)) != 0 || now() >= deadline)
            break;
    }
    if (set < 0)
        goto unlock;
    if (!set && !failure && !stop && !once && self->event_acquire) {
        double budget = limit - (now() - started);
        if (budget > self->sleep)
            budget = self->sleep;
        if (budget > 0 && (set = sleep_for_flag(self, flag, budget, &last, &failure)) < 0)
            goto unlock;
    }
    if (last) {
        PyObject *number = PyLong_FromUnsignedLongLong(last);
        int rc = number ? PyObject_SetAttr(self->channel, sent_name, number) : -1;
        Py_XDECREF(number);
        if (rc < 0)
            goto unlock;
    }
    if (failure) {
        PyObject *r = PyObject_CallMethodOneArg(self->channel, reap_failed_name, failure);
        if (!r)
            goto unlock;
        Py_DECREF(r);
    }
    if (mark_polled(self) < 0)
        goto unlock;
    result = set == 1 && !failure ? Py_True : Py_None;
    Py_INCREF(result);
unlock:
    Py_XDECREF(failure);
    {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyObject *r = PyObject_CallNoArgs(self->release);
        Py_XDECREF(r);
        if (type) {
            PyErr_Restore(type, value, tb);
        } else if (!r) {
            Py_CLEAR(result);
        }
    }
    if (last) {                            /* a send completed: wake whoever sleeps on one */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyObject *waiters = PyObject_GetAttr(self->channel, send_waiters_name);
        int any = waiters ? PyObject_IsTrue(waiters) : -1;
        Py_XDECREF(waiters);
        PyObject *r = any == 1 ? PyObject_CallMethodNoArgs(self->channel, wake_sends_name) : NULL;
        Py_XDECREF(r);
        if (type) {                        /* the first error stands */
            PyErr_Clear();
            PyErr_Restore(type, value, tb);
        } else if (any < 0 || (any == 1 && !r)) {
            Py_CLEAR(result);
        }
    }
    return result;
}

static int waiter_traverse(Waiter *self, visitproc visit, void *arg)
{
    Py_VISIT(self->ep);
    Py_VISIT(self->channel);
    Py_VISIT(self->on_imm);
    Py_VISIT(self->acquire);
    Py_VISIT(self->release);
    Py_VISIT(self->event_acquire);
    Py_VISIT(self->event_release);
    return 0;
}

static int waiter_clear(Waiter *self)
{
    Py_CLEAR(self->ep);
    Py_CLEAR(self->channel);
    Py_CLEAR(self->on_imm);
    Py_CLEAR(self->acquire);
    Py_CLEAR(self->release);
    Py_CLEAR(self->event_acquire);
    Py_CLEAR(self->event_release);
    return 0;
}

static void waiter_dealloc(Waiter *self)
{
    PyObject_GC_UnTrack(self);
    waiter_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject WaiterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "rdmatensor.providers.verbs._native_endpoint.Waiter",
    .tp_doc = "Endpoint.waiter(channel, on_imm, poll_lock, spin, event_lock=None, sleep=0)(flag, limit=None): "
              "True once the flag is set, None to take the channel's wait_for(); w(None) polls once",
    .tp_basicsize = sizeof(Waiter),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(Waiter, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_traverse = (traverseproc)waiter_traverse,
    .tp_clear = (inquiry)waiter_clear,
    .tp_dealloc = (destructor)waiter_dealloc,
};

static PyObject *ep_waiter(Endpoint *self, PyObject *args)
{
    PyObject *channel, *on_imm, *lock, *event_lock = Py_None;
    double spin, sleep = 0;
    if (!PyArg_ParseTuple(args, "OOOd|Od", &channel, &on_imm, &lock, &spin, &event_lock, &sleep) || check_open(self))
        return NULL;
    PyObject *acquire = PyObject_GetAttrString(lock, "acquire");
    PyObject *release = acquire ? PyObject_GetAttrString(lock, "release") : NULL;
    PyObject *event_acquire = NULL, *event_release = NULL;
    if (release && event_lock != Py_None) {
        event_acquire = PyObject_GetAttrString(event_lock, "acquire");
        event_release = event_acquire ? PyObject_GetAttrString(event_lock, "release") : NULL;
    }
    int ok = release && (event_lock == Py_None || event_release);
    Waiter *w = ok ? PyObject_GC_New(Waiter, &WaiterType) : NULL;
    if (!w) {
        Py_XDECREF(acquire);
        Py_XDECREF(release);
        Py_XDECREF(event_acquire);
        Py_XDECREF(event_release);
        return NULL;
    }
    w->vectorcall = (vectorcallfunc)waiter_vectorcall;
    w->ep = (Endpoint *)Py_NewRef(self);
    w->channel = Py_NewRef(channel);
    w->on_imm = Py_NewRef(on_imm);
    w->acquire = acquire;
    w->release = release;
    w->event_acquire = event_acquire;
    w->event_release = event_release;
    w->spin = spin;
    w->sleep = sleep;
    PyObject_GC_Track(w);
    return (PyObject *)w;
}

/* Block until the completion queue reports new work (at most `timeout` s),
 * with the GIL released; True if it did. Re-arms the queue, so the caller
 * polls once more afterwards. Safe from several threads at once. A waiter
 * that wants to sleep on the channel itself ends it early (False). */
static PyObject *ep_wait_event(Endpoint *self, PyObject *args)
{
    double timeout;
    if (!PyArg_ParseTuple(args, "d", &timeout) || check_open(self))
        return NULL;
    struct pollfd fds[3] = {{.fd = self->channel->fd, .events = POLLIN}, {.fd = self->wake_fd, .events = POLLIN},
                            {.fd = self->nudge_fd, .events = POLLIN}};
    int ms = timeout <= 0 ? 0 : timeout > 1e6 ? 1000000000 : (int)(timeout * 1000 + 0.999);
    int rc;
    __atomic_add_fetch(&self->busy, 1, __ATOMIC_ACQ_REL);
    Py_BEGIN_ALLOW_THREADS
    rc = poll(fds, 3, ms);
    Py_END_ALLOW_THREADS
    __atomic_sub_fetch(&self->busy, 1, __ATOMIC_ACQ_REL);
    if (rc < 0 && errno != EINTR)
        return verbs_error("waiting on the completion channel", errno);
    if (rc > 0 && (fds[2].revents & POLLIN)) {
        uint64_t count;
        if (read(self->nudge_fd, &count, sizeof count) < 0) { /* another reader reset it */ }
    }
    if (rc <= 0 || self->closing || !(fds[0].revents & POLLIN))
        Py_RETURN_FALSE;
    struct ibv_cq *cq;
    void *cq_ctx;
    if (ibv_get_cq_event(self->channel, &cq, &cq_ctx) == 0) {
        ibv_ack_cq_events(cq, 1);
        self->woken_waiting++;
        int err = ibv_req_notify_cq(self->cq, 0);
        if (err)
            return verbs_error("re-arming the completion queue", err);
    }            /* else another thread took this event */
    Py_RETURN_TRUE;
}

static PyObject *ep_close(Endpoint *self, PyObject *unused)
{
    ep_release(self);
    Py_RETURN_NONE;
}

static PyObject *ep_local(Endpoint *self, PyObject *unused)
{
    if (check_open(self))
        return NULL;
    return Py_BuildValue("(IIy#i)", self->qp->qp_num, self->psn, (const char *)self->gid.raw, (Py_ssize_t)16,
                         self->active_mtu);
}

static PyObject *ep_get_closed(Endpoint *s, void *c) { return PyBool_FromLong(s->closed); }
static PyObject *ep_get_depth(Endpoint *s, void *c) { return PyLong_FromLong(s->depth); }
static PyObject *ep_get_recv_depth(Endpoint *s, void *c) { return PyLong_FromLong(s->recv_depth); }
static PyObject *ep_get_device(Endpoint *s, void *c) { return PyUnicode_FromString(s->device); }
static PyObject *ep_get_port(Endpoint *s, void *c) { return PyLong_FromLong(s->port); }
static PyObject *ep_get_gid_index(Endpoint *s, void *c) { return PyLong_FromLong(s->gid_index); }
static PyObject *ep_get_max_inline(Endpoint *s, void *c) { return PyLong_FromUnsignedLong(s->max_inline); }
static PyObject *ep_get_in_flight(Endpoint *s, void *c)
{
    return PyLong_FromUnsignedLongLong(s->sends_posted - s->sends_completed);
}
static PyObject *ep_get_owed(Endpoint *s, void *c) { return PyLong_FromLong(s->n_owed); }
static PyObject *ep_get_arrivals(Endpoint *s, void *c) { return PyLong_FromUnsignedLongLong(s->arrivals); }
static PyObject *ep_get_deferring(Endpoint *s, void *c) { return PyBool_FromLong(s->deferring); }
static int ep_set_deferring(Endpoint *s, PyObject *v, void *c)
{
    int on = v ? PyObject_IsTrue(v) : 0;
    if (on < 0)
        return -1;
    s->deferring = on;
    return 0;
}
static PyObject *ep_get_on_owed(Endpoint *s, void *c) { return Py_NewRef(s->on_owed ? s->on_owed : Py_None); }
static int ep_set_on_owed(Endpoint *s, PyObject *v, void *c)
{
    if (v && v != Py_None && !PyCallable_Check(v)) {
        PyErr_SetString(PyExc_TypeError, "on_owed is a callable or None");
        return -1;
    }
    Py_XSETREF(s->on_owed, v && v != Py_None ? Py_NewRef(v) : NULL);
    return 0;
}
static PyObject *ep_get_wakeups(Endpoint *s, void *c)
{
    return Py_BuildValue("{sKsKsK}", "wait_event", (unsigned long long)s->woken_waiting,
                         "slept", (unsigned long long)s->woken_waiter,
                         "handed_over", (unsigned long long)s->handed_over);
}
static PyObject *ep_get_halted(Endpoint *s, void *c) { return PyBool_FromLong(s->halted); }
static int ep_set_halted(Endpoint *s, PyObject *v, void *c)
{
    int on = v ? PyObject_IsTrue(v) : 0;
    if (on < 0)
        return -1;
    s->halted = on;
    return 0;
}
static PyObject *ep_get_memory_regions(Endpoint *s, void *c)
{
    return s->mrs ? PyList_GetSlice(s->mrs, 0, PyList_GET_SIZE(s->mrs)) : PyList_New(0);
}

static PyGetSetDef ep_getset[] = {
    {"closed", (getter)ep_get_closed, NULL, "close() was called", NULL},
    {"depth", (getter)ep_get_depth, NULL, "send queue depth", NULL},
    {"recv_depth", (getter)ep_get_recv_depth, NULL, "receive queue depth", NULL},
    {"device", (getter)ep_get_device, NULL, "device name", NULL},
    {"port", (getter)ep_get_port, NULL, "port number", NULL},
    {"gid_index", (getter)ep_get_gid_index, NULL, "GID index", NULL},
    {"max_inline", (getter)ep_get_max_inline, NULL, "writes up to this size go inline", NULL},
    {"in_flight", (getter)ep_get_in_flight, NULL, "sends posted and not yet completed", NULL},
    {"owed", (getter)ep_get_owed, NULL, "immediates owed: they lead the next chain posted", NULL},
    {"arrivals", (getter)ep_get_arrivals, NULL, "receives completed well so far (each one posted by the peer)", NULL},
    {"deferring", (getter)ep_get_deferring, (setter)ep_set_deferring,
     "while set, owe() takes immediates; clear it, then post_owed(), and none stays owed", NULL},
    {"wakeups", (getter)ep_get_wakeups, NULL,
     "{'wait_event': CQ events taken by wait_event(), 'slept': waits that ended asleep on the channel, "
     "'handed_over': waits left to the thread that held the poll or the event lock}", NULL},
    {"on_owed", (getter)ep_get_on_owed, (setter)ep_set_on_owed,
     "None, or called once (then None again) when owe() next takes an immediate", NULL},
    {"halted", (getter)ep_get_halted, (setter)ep_set_halted,
     "while set, prepared writes post nothing (they return 0: take the checked path)", NULL},
    {"memory_regions", (getter)ep_get_memory_regions, NULL, "regions registered and not deregistered", NULL},
    {NULL},
};

static PyMethodDef ep_methods[] = {
    {"register", (PyCFunction)(void (*)(void))ep_register, METH_VARARGS | METH_KEYWORDS,
     "register(buffer, access=LOCAL_WRITE|REMOTE_WRITE) -> MemoryRegion: writable C-contiguous memory, kept alive until deregistered"},
    {"deregister", (PyCFunction)ep_deregister, METH_O, "deregister(mr): idempotent"},
    {"connect_qp", (PyCFunction)ep_connect_qp, METH_VARARGS,
     "connect_qp(qpn, psn, gid16, mtu_enum, is_global=1, dlid=0, sl=0, hop_limit=64, traffic_class=0, "
     "timeout=14, retry_cnt=7): the queue pair to RTR and RTS along the route (addressing.py)"},
    {"local", (PyCFunction)ep_local, METH_NOARGS, "(qpn, psn, gid16, active_mtu_enum) of this side"},
    {"post_write", (PyCFunction)(void (*)(void))ep_post_write, METH_VARARGS | METH_KEYWORDS,
     "post_write(src, (addr, length, rkey), offset, imm=None) -> send number, 0 if the send queue is full"},
    {"prepare_write", (PyCFunction)(void (*)(void))ep_prepare_write, METH_VARARGS | METH_KEYWORDS,
     "prepare_write(src, (addr, length, rkey), offset, imm=None) -> PreparedWrite: checked now; calling it "
     "posts it (its send number, 0 if it did not post: halted, closed, source gone, queue full)"},
    {"post_writes", (PyCFunction)ep_post_writes, METH_O,
     "post_writes([(src, (addr, length, rkey), offset, imm), ...]) -> the first's send number (the others "
     "follow), 0 if the send queue lacks room; one doorbell, at most MAX_CHAIN writes, all checked first"},
    {"post_send_imm", (PyCFunction)ep_post_send_imm, METH_O,
     "post_send_imm(imm) -> send number (0: queue full): a zero-length SEND carrying an immediate"},
    {"owe", (PyCFunction)ep_owe, METH_O,
     "owe(imm) -> bool: while deferring, the immediate leads the next chain posted instead of a post of its own"},
    {"post_owed", (PyCFunction)ep_post_owed, METH_NOARGS,
     "post_owed() -> bool: post what is owed now; False if the send queue lacks room"},
    {"post_send", (PyCFunction)ep_post_send, METH_O, "post_send(src) -> send number (0: queue full): a SEND"},
    {"post_recv", (PyCFunction)ep_post_recv, METH_VARARGS,
     "post_recv(count=1): give back receives for immediates, in chained batches"},
    {"post_recv_into", (PyCFunction)ep_post_recv_into, METH_VARARGS,
     "post_recv_into(dst, recv_id): one receive into registered local-only memory"},
    {"poll", (PyCFunction)(void (*)(void))ep_poll, METH_VARARGS | METH_KEYWORDS,
     "poll(max_entries=32, spin=0.0) -> [(wr_id, status, is_receive, imm, byte_len)]"},
    {"waiter", (PyCFunction)ep_waiter, METH_VARARGS,
     "waiter(channel, on_imm, poll_lock, spin) -> Waiter: w(flag, limit=None) spins in C for the flag up to "
     "`spin` (or `limit`) s, as the channel's wait_for() does; True once it is set, None to take wait_for()"},
    {"reap", (PyCFunction)ep_reap, METH_VARARGS,
     "reap(on_imm, spin=0.0) -> (found, last_send_done, failed): poll(), receives given back and their "
     "immediates passed to on_imm in order, up to the first failure, (wr_id, status, is_receive)"},
    {"wait_event", (PyCFunction)ep_wait_event, METH_VARARGS,
     "wait_event(timeout) -> bool: block on the completion channel, GIL released"},
    {"close", (PyCFunction)ep_close, METH_NOARGS, "free everything, children first; idempotent"},
    {NULL},
};

static PyTypeObject EndpointType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "rdmatensor.providers.verbs._native_endpoint.Endpoint",
    .tp_doc = "Endpoint(device, port=1, gid_index=0, depth=256, recv_depth=256, psn=0): one RC queue pair",
    .tp_basicsize = sizeof(Endpoint),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_new = ep_new,
    .tp_init = (initproc)ep_init,
    .tp_dealloc = (destructor)ep_dealloc,
    .tp_methods = ep_methods,
    .tp_getset = ep_getset,
};

#define STATUS(name) case name: return #name;
static const char *status_enum_name(int status)
{
    switch (status) {
    STATUS(IBV_WC_SUCCESS) STATUS(IBV_WC_LOC_LEN_ERR) STATUS(IBV_WC_LOC_QP_OP_ERR) STATUS(IBV_WC_LOC_EEC_OP_ERR)
    STATUS(IBV_WC_LOC_PROT_ERR) STATUS(IBV_WC_WR_FLUSH_ERR) STATUS(IBV_WC_MW_BIND_ERR) STATUS(IBV_WC_BAD_RESP_ERR)
    STATUS(IBV_WC_LOC_ACCESS_ERR) STATUS(IBV_WC_REM_INV_REQ_ERR) STATUS(IBV_WC_REM_ACCESS_ERR)
    STATUS(IBV_WC_REM_OP_ERR) STATUS(IBV_WC_RETRY_EXC_ERR) STATUS(IBV_WC_RNR_RETRY_EXC_ERR)
    STATUS(IBV_WC_LOC_RDD_VIOL_ERR) STATUS(IBV_WC_REM_INV_RD_REQ_ERR) STATUS(IBV_WC_REM_ABORT_ERR)
    STATUS(IBV_WC_INV_EECN_ERR) STATUS(IBV_WC_INV_EEC_STATE_ERR) STATUS(IBV_WC_FATAL_ERR)
    STATUS(IBV_WC_RESP_TIMEOUT_ERR) STATUS(IBV_WC_GENERAL_ERR)
    default: return "unknown";
    }
}

/* The name pyverbs would give (IBV_WC_RETRY_EXC_ERR), as the other endpoint reports it. */
static PyObject *status_name(PyObject *mod, PyObject *arg)
{
    long status = PyLong_AsLong(arg);
    if (status == -1 && PyErr_Occurred())
        return NULL;
    return PyUnicode_FromString(status_enum_name((int)status));
}

/* The pairing posts use, for the test that it is contract.py's. */
static PyObject *module_pair_imm(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "pair_imm(data, credit)");
        return NULL;
    }
    uint32_t data, credit;
    if (parse_imm(args[0], &data) < 0 || parse_imm(args[1], &credit) < 0)
        return NULL;
    uint32_t both = pair_imm(data, credit);
    if (!both)
        Py_RETURN_NONE;
    return PyLong_FromUnsignedLong(both);
}

static PyMethodDef module_methods[] = {
    {"status_name", status_name, METH_O, "a work completion status, as verbs names it"},
    {"pair_imm", (PyCFunction)(void (*)(void))module_pair_imm, METH_FASTCALL,
     "pair_imm(data, credit) -> the PAIR immediate posts use, or None (providers/contract.py's pair_imm)"},
    {NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_native_endpoint", "A compiled RC endpoint (see native_endpoint.py).", -1, module_methods,
};

PyMODINIT_FUNC PyInit__native_endpoint(void)
{
    PyObject *errors = PyImport_ImportModule("rdmatensor.errors");
    if (!errors)
        return NULL;
    DeviceError = PyObject_GetAttrString(errors, "DeviceError");
    VerbsError = PyObject_GetAttrString(errors, "VerbsError");
    TransportError = PyObject_GetAttrString(errors, "TransportError");
    UsageError = PyObject_GetAttrString(errors, "UsageError");
    Py_DECREF(errors);
    if (!DeviceError || !VerbsError || !TransportError || !UsageError)
        return NULL;
    is_set_name = PyUnicode_InternFromString("is_set");
    closing_name = PyUnicode_InternFromString("_closing");
    sent_name = PyUnicode_InternFromString("_sent");
    polled_at_name = PyUnicode_InternFromString("_polled_at");
    send_waiters_name = PyUnicode_InternFromString("_send_waiters");
    wake_sends_name = PyUnicode_InternFromString("_wake_sends");
    reap_failed_name = PyUnicode_InternFromString("_reap_failed");
    if (!is_set_name || !closing_name || !sent_name || !polled_at_name || !send_waiters_name || !wake_sends_name
        || !reap_failed_name)
        return NULL;
    if (PyType_Ready(&MemoryRegionType) < 0 || PyType_Ready(&EndpointType) < 0 ||
        PyType_Ready(&PreparedWriteType) < 0 || PyType_Ready(&WaiterType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    Py_INCREF(&EndpointType);
    Py_INCREF(&MemoryRegionType);
    if (PyModule_AddObject(m, "Endpoint", (PyObject *)&EndpointType) < 0 ||
        PyModule_AddObject(m, "MemoryRegion", (PyObject *)&MemoryRegionType) < 0 ||
        PyModule_AddIntConstant(m, "RECV_BATCH", RECV_BATCH) < 0 ||
        PyModule_AddIntConstant(m, "MAX_CHAIN", MAX_CHAIN) < 0 ||
        PyModule_AddIntConstant(m, "ACCESS_LOCAL_WRITE", IBV_ACCESS_LOCAL_WRITE) < 0 ||
        PyModule_AddIntConstant(m, "ACCESS_REMOTE_WRITE", IBV_ACCESS_REMOTE_WRITE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
