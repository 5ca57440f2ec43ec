/* A slot's state and the immediates that move it, compiled (credits.py and
 * flag.py have the same in Python, and the contract).
 *
 * Every tensor moves two flags and one small state machine: its DATA
 * immediate makes the receiver's slot FULL, recv() takes it, release() empties
 * it and its CREDIT immediate gives the sender its credit back.  Here each
 * transition is a few stores under the GIL, which also makes it atomic with
 * respect to every other thread: no lock is needed.
 *
 *   Flag          is_set / set / clear; set() calls self._wake() only while
 *                 a thread sleeps on it (flag.py's Flag adds wait()).
 *   SlotState     EMPTY --arrive--> FULL --take--> HELD --release--> EMPTY,
 *                 wake(), and replace() of its memory only while EMPTY.
 *   Immediates    a channel's on_imm: DATA, CREDIT and PAIR for bound slots, in C;
 *                 anything else goes to the Python on_imm, which raises what
 *                 the rules say (credits.py).
 *   Received      a value lent out (recv.py's).
 *   SendState     the sender's end of a slot, the fields the hop reads.
 *   Hop           Session.send, recv and release for the common case in C,
 *                 the Python path (send.py, recv.py) for everything else.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>

#define IMM_DATA 0               /* providers/contract.py's kinds */
#define IMM_CREDIT 1
#define IMM_PAIR 2
#define PAIR_BITS 15

/* -- Flag ------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    char flag;
    Py_ssize_t sleepers;
} Flag;

static PyTypeObject FlagType;
static PyObject *wake_name, *empty_str, *full_str, *held_str;

static int Flag_init(Flag *self, PyObject *args, PyObject *kw) {
    int value = 0;
    static char *names[] = {"value", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|p", names, &value))
        return -1;
    self->flag = (char)value;
    self->sleepers = 0;
    return 0;
}

static int flag_set(Flag *f) {
    f->flag = 1;
    if (!f->sleepers)
        return 0;
    PyObject *r = PyObject_CallMethodNoArgs((PyObject *)f, wake_name);
    if (!r)
        return -1;
    Py_DECREF(r);
    return 0;
}

static PyObject *Flag_is_set(Flag *self, PyObject *unused) { return PyBool_FromLong(self->flag); }

static PyObject *Flag_set(Flag *self, PyObject *unused) {
    if (flag_set(self) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Flag_clear(Flag *self, PyObject *unused) {
    self->flag = 0;
    Py_RETURN_NONE;
}

static PyMethodDef Flag_methods[] = {
    {"is_set", (PyCFunction)Flag_is_set, METH_NOARGS, "whether the flag is set"},
    {"set", (PyCFunction)Flag_set, METH_NOARGS, "set it, waking sleepers (self._wake())"},
    {"clear", (PyCFunction)Flag_clear, METH_NOARGS, "clear it"},
    {NULL},
};

static PyMemberDef Flag_members[] = {
    {"_sleepers", T_PYSSIZET, offsetof(Flag, sleepers), 0, "threads sleeping on the flag"},
    {NULL},
};

static PyTypeObject FlagType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "rdmatensor.session._slots.Flag",
    .tp_basicsize = sizeof(Flag),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "Flag(value=False): set, clear and look at it; sleeping is the subclass's",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Flag_init,
    .tp_methods = Flag_methods,
    .tp_members = Flag_members,
};

/* -- SlotState ------------------------------------------------------- */

enum { EMPTY, FULL, HELD };

typedef struct {
    PyObject_HEAD
    int state;
    char woken;
    unsigned long tag;
    Flag *arrived;               /* set while FULL, or for good once woken */
    PyObject *memory, *view, *grown;
    Py_ssize_t recvs;            /* values handed out (each Received built counts one) */
    long long bytes_received;
    PyObject *peer;              /* the sender's rank (int), and the CREDIT immediate that gives */
    PyObject *credit_imm;        /* this slot back: objects, so that Python reads them fast too */
} SlotState;

static int SlotState_init(SlotState *self, PyObject *args, PyObject *kw) {
    PyObject *memory, *arrived;
    static char *names[] = {"memory", "arrived", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO!", names, &memory, &FlagType, &arrived))
        return -1;
    Py_INCREF(memory);
    Py_XSETREF(self->memory, memory);
    Py_INCREF(arrived);
    Py_XSETREF(self->arrived, (Flag *)arrived);
    Py_CLEAR(self->view);
    Py_CLEAR(self->grown);
    self->state = EMPTY;
    self->woken = 0;
    self->tag = 0;
    self->recvs = 0;
    self->bytes_received = 0;
    return 0;
}

static PyObject *state_name(int state) {
    PyObject *s = state == EMPTY ? empty_str : state == FULL ? full_str : held_str;
    Py_INCREF(s);
    return s;
}

static int ready(SlotState *s) {
    if (s->arrived)
        return 1;
    PyErr_SetString(PyExc_ValueError, "the SlotState was not initialized");
    return 0;
}

static void slot_arrive(SlotState *s, unsigned long tag) {   /* only from EMPTY */
    s->tag = tag;
    s->state = FULL;
}

/* arrive(tag): EMPTY -> FULL; False (nothing changed) from any other state. */
static PyObject *SlotState_arrive(SlotState *self, PyObject *arg) {
    unsigned long tag = PyLong_AsUnsignedLong(arg);
    if (tag == (unsigned long)-1 && PyErr_Occurred())
        return NULL;
    if (!ready(self))
        return NULL;
    if (self->state != EMPTY)
        Py_RETURN_FALSE;
    slot_arrive(self, tag);
    if (flag_set(self->arrived) < 0)
        return NULL;
    Py_RETURN_TRUE;
}

static PyObject *SlotState_take(SlotState *self, PyObject *unused) {
    if (self->state != FULL)
        Py_RETURN_FALSE;
    self->state = HELD;
    Py_RETURN_TRUE;
}

static void slot_release(SlotState *s) {   /* -> EMPTY (release() and the hop's) */
    s->state = EMPTY;
    if (!s->woken)               /* a loss must keep waking later waiters */
        s->arrived->flag = 0;
}

static PyObject *SlotState_release(SlotState *self, PyObject *unused) {
    if (!ready(self))
        return NULL;
    slot_release(self);
    Py_RETURN_NONE;
}

static PyObject *SlotState_wake(SlotState *self, PyObject *unused) {
    if (!ready(self))
        return NULL;
    self->woken = 1;
    if (flag_set(self->arrived) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* replace(grown, memory): new memory, only while EMPTY; the `grown` it replaces,
 * or None with nothing changed while a value is in the slot. */
static PyObject *SlotState_replace(SlotState *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "replace(grown, memory)");
        return NULL;
    }
    if (self->state != EMPTY)
        return Py_BuildValue("(OO)", Py_False, Py_None);
    PyObject *old = self->grown;
    Py_INCREF(args[0]);
    Py_INCREF(args[1]);
    self->grown = args[0];
    Py_XSETREF(self->memory, args[1]);
    Py_CLEAR(self->view);
    self->view = Py_None;
    Py_INCREF(Py_None);
    PyObject *r = Py_BuildValue("(OO)", Py_True, old ? old : Py_None);
    Py_XDECREF(old);
    return r;
}

static PyObject *SlotState_get_state(SlotState *self, void *unused) { return state_name(self->state); }

static PyObject *SlotState_get_tag(SlotState *self, void *unused) { return PyLong_FromUnsignedLong(self->tag); }

static PyObject *SlotState_get_arrived(SlotState *self, void *unused) {
    if (!ready(self))
        return NULL;
    Py_INCREF(self->arrived);
    return (PyObject *)self->arrived;
}

static int SlotState_traverse(SlotState *self, visitproc visit, void *arg) {
    Py_VISIT(self->arrived);
    Py_VISIT(self->memory);
    Py_VISIT(self->view);
    Py_VISIT(self->grown);
    Py_VISIT(self->peer);
    Py_VISIT(self->credit_imm);
    return 0;
}

static int SlotState_clear(SlotState *self) {
    Py_CLEAR(self->arrived);
    Py_CLEAR(self->memory);
    Py_CLEAR(self->view);
    Py_CLEAR(self->grown);
    Py_CLEAR(self->peer);
    Py_CLEAR(self->credit_imm);
    return 0;
}

static void SlotState_dealloc(SlotState *self) {
    PyObject_GC_UnTrack(self);
    SlotState_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef SlotState_methods[] = {
    {"arrive", (PyCFunction)SlotState_arrive, METH_O, "arrive(tag): EMPTY -> FULL; False from any other state"},
    {"take", (PyCFunction)SlotState_take, METH_NOARGS, "FULL -> HELD; False when there is no value"},
    {"release", (PyCFunction)SlotState_release, METH_NOARGS, "-> EMPTY"},
    {"wake", (PyCFunction)SlotState_wake, METH_NOARGS, "wake every waiter, for good"},
    {"replace", (PyCFunction)(void (*)(void))SlotState_replace, METH_FASTCALL,
     "replace(grown, memory) -> (replaced, the grown it replaces)"},
    {NULL},
};

static PyGetSetDef SlotState_getset[] = {
    {"state", (getter)SlotState_get_state, NULL, "empty, full or held", NULL},
    {"tag", (getter)SlotState_get_tag, NULL, "the sender's tag of the value in the slot", NULL},
    {"arrived", (getter)SlotState_get_arrived, NULL, "set while FULL, or for good once woken", NULL},
    {NULL},
};

static PyMemberDef SlotState_members[] = {
    {"memory", T_OBJECT, offsetof(SlotState, memory), 0, "the slot's bytes in the receive arena"},
    {"view", T_OBJECT, offsetof(SlotState, view), 0, "the read-only tensor in memory"},
    {"grown", T_OBJECT, offsetof(SlotState, grown), READONLY, "(region id, arena) once grown"},
    {"recvs", T_PYSSIZET, offsetof(SlotState, recvs), 0, "values handed out"},
    {"bytes_received", T_LONGLONG, offsetof(SlotState, bytes_received), 0, "their bytes"},
    {"peer", T_OBJECT_EX, offsetof(SlotState, peer), 0, "the sender's rank"},
    {"credit_imm", T_OBJECT_EX, offsetof(SlotState, credit_imm), 0, "the CREDIT immediate that gives the slot back"},
    {NULL},
};

static PyTypeObject SlotStateType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "rdmatensor.session._slots.SlotState",
    .tp_basicsize = sizeof(SlotState),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A receive slot's state machine (credits.py's RecvSlot)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)SlotState_init,
    .tp_traverse = (traverseproc)SlotState_traverse,
    .tp_clear = (inquiry)SlotState_clear,
    .tp_dealloc = (destructor)SlotState_dealloc,
    .tp_methods = SlotState_methods,
    .tp_getset = SlotState_getset,
    .tp_members = SlotState_members,
};

/* -- Immediates ------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *fallback;          /* the Python on_imm: the rules, and their errors */
    PyObject *recv, *credits;    /* tuples: SlotState by slot index, the send slots' credit Flags */
    int index_bits;
} Immediates;

static int Immediates_init(Immediates *self, PyObject *args, PyObject *kw) {
    PyObject *fallback;
    int index_bits;
    static char *names[] = {"fallback", "index_bits", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "Oi", names, &fallback, &index_bits))
        return -1;
    if (index_bits < 1 || index_bits > 29) {
        PyErr_SetString(PyExc_ValueError, "index_bits is in 1..29");
        return -1;
    }
    Py_INCREF(fallback);
    Py_XSETREF(self->fallback, fallback);
    Py_XSETREF(self->recv, PyTuple_New(0));
    Py_XSETREF(self->credits, PyTuple_New(0));
    self->index_bits = index_bits;
    return self->recv && self->credits ? 0 : -1;
}

/* bind(receiving, credits): the slots this channel's immediates move. */
static PyObject *Immediates_bind(Immediates *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "bind(receiving, credits)");
        return NULL;
    }
    PyObject *recv = PySequence_Tuple(args[0]), *credits = recv ? PySequence_Tuple(args[1]) : NULL;
    if (!credits)
        goto bad;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(recv); i++) {
        SlotState *s = (SlotState *)PyTuple_GET_ITEM(recv, i);
        if (!PyObject_TypeCheck((PyObject *)s, &SlotStateType) || !s->arrived) {
            PyErr_SetString(PyExc_TypeError, "bind() takes SlotStates with their `arrived` Flag");
            goto bad;
        }
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(credits); i++)
        if (!PyObject_TypeCheck(PyTuple_GET_ITEM(credits, i), &FlagType)) {
            PyErr_SetString(PyExc_TypeError, "bind() takes the send slots' credit Flags");
            goto bad;
        }
    Py_XSETREF(self->recv, recv);
    Py_XSETREF(self->credits, credits);
    Py_RETURN_NONE;
bad:
    Py_XDECREF(recv);
    Py_XDECREF(credits);
    return NULL;
}

static PyObject *Immediates_vectorcall(Immediates *self, PyObject *const *args, size_t nargsf, PyObject *kw) {
    if (PyVectorcall_NARGS(nargsf) != 1 || kw) {
        PyErr_SetString(PyExc_TypeError, "on_imm(imm)");
        return NULL;
    }
    unsigned long imm = PyLong_AsUnsignedLong(args[0]);
    if (imm == (unsigned long)-1 && PyErr_Occurred())
        return NULL;
    unsigned long kind = imm >> 30, index = imm & ((1ul << self->index_bits) - 1);
    if (kind == IMM_DATA && index < (unsigned long)PyTuple_GET_SIZE(self->recv)) {
        SlotState *s = (SlotState *)PyTuple_GET_ITEM(self->recv, index);
        if (s->state == EMPTY) {
            slot_arrive(s, (imm & ((1ul << 30) - 1)) >> self->index_bits);
            if (flag_set(s->arrived) < 0)
                return NULL;
            Py_RETURN_NONE;
        }
    } else if (kind == IMM_CREDIT && index < (unsigned long)PyTuple_GET_SIZE(self->credits)) {
        if (flag_set((Flag *)PyTuple_GET_ITEM(self->credits, index)) < 0)
            return NULL;
        Py_RETURN_NONE;
    } else if (kind == IMM_PAIR) {        /* a credit, then a tag-0 value: both valid, or the rules decide */
        unsigned long credit = (imm >> PAIR_BITS) & ((1ul << PAIR_BITS) - 1), data = imm & ((1ul << PAIR_BITS) - 1);
        if (credit < (unsigned long)PyTuple_GET_SIZE(self->credits) &&
            data < (unsigned long)PyTuple_GET_SIZE(self->recv)) {
            SlotState *s = (SlotState *)PyTuple_GET_ITEM(self->recv, data);
            if (s->state == EMPTY) {
                if (flag_set((Flag *)PyTuple_GET_ITEM(self->credits, credit)) < 0)
                    return NULL;
                slot_arrive(s, 0);
                if (flag_set(s->arrived) < 0)
                    return NULL;
                Py_RETURN_NONE;
            }
        }
    }
    return PyObject_CallOneArg(self->fallback, args[0]);     /* against the rules: the rules say how */
}

static int Immediates_traverse(Immediates *self, visitproc visit, void *arg) {
    Py_VISIT(self->fallback);
    Py_VISIT(self->recv);
    Py_VISIT(self->credits);
    return 0;
}

static int Immediates_clear(Immediates *self) {
    Py_CLEAR(self->fallback);
    Py_CLEAR(self->recv);
    Py_CLEAR(self->credits);
    return 0;
}

static void Immediates_dealloc(Immediates *self) {
    PyObject_GC_UnTrack(self);
    Immediates_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Immediates_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    Immediates *self = (Immediates *)type->tp_alloc(type, 0);
    if (self)
        self->vectorcall = (vectorcallfunc)Immediates_vectorcall;
    return (PyObject *)self;
}

static PyMethodDef Immediates_methods[] = {
    {"bind", (PyCFunction)(void (*)(void))Immediates_bind, METH_FASTCALL, "bind(receiving, credits)"},
    {NULL},
};

static PyTypeObject ImmediatesType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "rdmatensor.session._slots.Immediates",
    .tp_basicsize = sizeof(Immediates),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "Immediates(fallback, index_bits): a channel's on_imm(imm)",
    .tp_new = Immediates_new,
    .tp_init = (initproc)Immediates_init,
    .tp_traverse = (traverseproc)Immediates_traverse,
    .tp_clear = (inquiry)Immediates_clear,
    .tp_dealloc = (destructor)Immediates_dealloc,
    .tp_methods = Immediates_methods,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Immediates, vectorcall),
};

/* -- Received -------------------------------------------------------- */
/* recv.py's Received: a received value lent out, its slot going back to the
 * sender when it is released (credits.give_back). A C type so that the two
 * calls every received tensor makes, building one and releasing it, run no
 * interpreter frame of their own. */

typedef struct {
    PyObject_HEAD
    PyObject *credits, *state, *array, *name, *tag;
    PyObject *weakrefs;
} Received;

static PyObject *give_back_name, *name_name, *nbytes_name;

/* Fill a Received: the slot `state` lent out as `array`, going back through credits.give_back. */
static int received_fill(Received *self, PyObject *credits, PyObject *state, PyObject *array) {
    PyObject *name = PyObject_GetAttr(state, name_name);
    if (!name)
        return -1;
    PyObject *tag = PyLong_FromUnsignedLong(((SlotState *)state)->tag);
    PyObject *nbytes = tag ? PyObject_GetAttr(array, nbytes_name) : NULL;
    long long n = nbytes ? PyLong_AsLongLong(nbytes) : -1;
    Py_XDECREF(nbytes);
    if (n == -1 && (!tag || PyErr_Occurred())) {
        Py_DECREF(name);
        Py_XDECREF(tag);
        return -1;
    }
    ((SlotState *)state)->recvs++;          /* per slot: only the thread that took the value counts it */
    ((SlotState *)state)->bytes_received += n;
    Py_INCREF(credits);
    Py_INCREF(state);
    Py_INCREF(array);
    Py_XSETREF(self->credits, credits);
    Py_XSETREF(self->state, state);
    Py_XSETREF(self->array, array);
    Py_XSETREF(self->name, name);
    Py_XSETREF(self->tag, tag);
    return 0;
}

static int Received_init(Received *self, PyObject *args, PyObject *kw) {
    PyObject *credits, *state, *array;
    static char *names[] = {"credits", "state", "array", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO!O", names, &credits, &SlotStateType, &state, &array))
        return -1;
    return received_fill(self, credits, state, array);
}

static PyTypeObject HopType;
static PyObject *hop_give_back(PyObject *hop, SlotState *state);

static PyObject *Received_release(Received *self, PyObject *unused) {
    if (!self->state || self->state == Py_None)
        Py_RETURN_NONE;
    PyObject *state = self->state;
    self->state = NULL;
    Py_INCREF(Py_None);
    Py_XSETREF(self->array, Py_None);
    PyObject *r = !self->credits ? NULL
        : Py_IS_TYPE(self->credits, &HopType) ? hop_give_back(self->credits, (SlotState *)state)
        : PyObject_CallMethodOneArg(self->credits, give_back_name, state);
    Py_DECREF(state);
    return r;
}

static PyObject *Received_exit(Received *self, PyObject *const *args, Py_ssize_t nargs) {
    return Received_release(self, NULL);
}

static PyObject *Received_enter(Received *self, PyObject *unused) {
    if (!self->state) {          /* rdmatensor.errors.UsageError, naming the tensor */
        PyObject *errors = PyImport_ImportModule("rdmatensor.errors");
        PyObject *cls = errors ? PyObject_GetAttrString(errors, "UsageError") : NULL;
        Py_XDECREF(errors);
        if (!cls)
            return NULL;
        PyObject *msg = PyUnicode_FromFormat("tensor %R was already released", self->name ? self->name : Py_None);
        PyObject *call_args = msg ? PyTuple_Pack(1, msg) : NULL;
        PyObject *kwargs = call_args ? Py_BuildValue("{sO}", "tensor", self->name ? self->name : Py_None) : NULL;
        PyObject *exc = kwargs ? PyObject_Call(cls, call_args, kwargs) : NULL;
        if (exc) {
            PyErr_SetObject(cls, exc);
            Py_DECREF(exc);
        }
        Py_DECREF(cls);
        Py_XDECREF(msg);
        Py_XDECREF(call_args);
        Py_XDECREF(kwargs);
        return NULL;
    }
    Py_INCREF(self->array);
    return self->array;
}

static PyObject *Received_released(Received *self, void *unused) {
    return PyBool_FromLong(!self->state);
}

static int Received_traverse(Received *self, visitproc visit, void *arg) {
    Py_VISIT(self->credits);
    Py_VISIT(self->state);
    Py_VISIT(self->array);
    return 0;
}

static int Received_clear(Received *self) {
    Py_CLEAR(self->credits);
    Py_CLEAR(self->state);
    Py_CLEAR(self->array);
    Py_CLEAR(self->name);
    Py_CLEAR(self->tag);
    return 0;
}

static void Received_dealloc(Received *self) {
    PyObject_GC_UnTrack(self);
    if (self->weakrefs)
        PyObject_ClearWeakRefs((PyObject *)self);
    Received_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Received_methods[] = {
    {"release", (PyCFunction)Received_release, METH_NOARGS, "hand the slot back to the sender (idempotent)"},
    {"__enter__", (PyCFunction)Received_enter, METH_NOARGS, "the array"},
    {"__exit__", (PyCFunction)(void (*)(void))Received_exit, METH_FASTCALL, "release()"},
    {NULL},
};

static PyMemberDef Received_members[] = {
    {"array", T_OBJECT, offsetof(Received, array), READONLY, "the read-only view (None once released)"},
    {"name", T_OBJECT, offsetof(Received, name), READONLY, "the tensor's name"},
    {"tag", T_OBJECT, offsetof(Received, tag), READONLY, "the sender's tag of the value"},
    {NULL},
};

static PyGetSetDef Received_getset[] = {
    {"released", (getter)Received_released, NULL, "whether the slot went back", NULL},
    {NULL},
};

static PyTypeObject ReceivedType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "rdmatensor.Received",
    .tp_basicsize = sizeof(Received),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A received tensor: a read-only view of the receive arena itself.\n\n"
              "Use as a context manager (`with session.recv(name) as array:`); leaving\n"
              "the block (or `release()`) hands the slot back to the sender.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Received_init,
    .tp_dealloc = (destructor)Received_dealloc,
    .tp_traverse = (traverseproc)Received_traverse,
    .tp_clear = (inquiry)Received_clear,
    .tp_weaklistoffset = offsetof(Received, weakrefs),
    .tp_methods = Received_methods,
    .tp_members = Received_members,
    .tp_getset = Received_getset,
};

/* -- SendState ------------------------------------------------------ */
/* credits.py's SendSlot, the fields its hop reads: its credit, the staging view
 * and the prepared write of it, the last write's handle, its counters. All
 * objects (T_OBJECT_EX), which the interpreter reads and writes as fast as
 * an instance's own attributes: the Python path keeps its speed. */

#define SEND_FIELDS(X) X(credit) X(view) X(seal) X(post) X(pending) X(writes) X(bytes_sent) X(nbytes) X(peer) X(raw)

typedef struct {
    PyObject_HEAD
#define FIELD(f) PyObject *f;
    SEND_FIELDS(FIELD)
#undef FIELD
} SendState;

static int SendState_traverse(SendState *self, visitproc visit, void *arg) {
#define FIELD(f) Py_VISIT(self->f);
    SEND_FIELDS(FIELD)
#undef FIELD
    return 0;
}

static int SendState_clear(SendState *self) {
#define FIELD(f) Py_CLEAR(self->f);
    SEND_FIELDS(FIELD)
#undef FIELD
    return 0;
}

static void SendState_dealloc(SendState *self) {
    PyObject_GC_UnTrack(self);
    SendState_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef SendState_members[] = {
    {"credit", T_OBJECT_EX, offsetof(SendState, credit), 0, "set: this side may write the slot"},
    {"view", T_OBJECT_EX, offsetof(SendState, view), 0, "staging as the tensor (static ones), once buffer() made it"},
    {"seal", T_OBJECT_EX, offsetof(SendState, seal), 0, "`view`'s setflags: read-only from its send to the next buffer()"},
    {"post", T_OBJECT_EX, offsetof(SendState, post), 0, "the channel's prepared write of `view` (tag 0), or None"},
    {"pending", T_OBJECT_EX, offsetof(SendState, pending), 0, "the last write's handle, while it may read staging"},
    {"writes", T_OBJECT_EX, offsetof(SendState, writes), 0, "writes posted"},
    {"bytes_sent", T_OBJECT_EX, offsetof(SendState, bytes_sent), 0, "their bytes"},
    {"nbytes", T_OBJECT_EX, offsetof(SendState, nbytes), 0, "the bytes of one write of `view`"},
    {"peer", T_OBJECT_EX, offsetof(SendState, peer), 0, "the receiver's rank"},
    {"raw", T_OBJECT_EX, offsetof(SendState, raw), 0, "a static value goes as it is: no header, no checksum, not empty"},
    {NULL},
};

static PyTypeObject SendStateType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "rdmatensor.session._slots.SendState",
    .tp_basicsize = sizeof(SendState),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The sender's end of a slot, as its hop reads it (credits.py's SendSlot)",
    .tp_new = PyType_GenericNew,
    .tp_traverse = (traverseproc)SendState_traverse,
    .tp_clear = (inquiry)SendState_clear,
    .tp_dealloc = (destructor)SendState_dealloc,
    .tp_members = SendState_members,
};

/* -- Hop ------------------------------------------------------------- */
/* A session's send(), recv() and release, compiled for the common case: a
 * static tensor sent from its staging with its prepared write while its
 * credit is in, a value handed over as the view it always is, a credit owed
 * to the next write. Anything else (a wait for a credit, a tag, a dynamic
 * tensor, an error, a refusal) goes to the Python path (send.py, recv.py,
 * credits.py), which decides it: one contract, the same errors. Under
 * emulation every interpreter frame of a hop costs microseconds. */

typedef struct {
    PyObject_HEAD
    PyObject *send_slots, *recv_slots;      /* dicts: name -> SendState, name -> SlotState */
    PyObject *live, *peer_errors, *ctx, *channels;
    PyObject *sinks, *waiters;              /* peer -> its channel's credit_sink(), waiter(), or None */
    PyObject *send_rest, *recv_rest, *timed_out, *return_credit;   /* the Python path */
} Hop;

static PyObject *error_name, *closed_name, *timeout_name, *wait_for_name, *credit_sink_name, *waiter_name, *one;

/* The compiled part `method`() of `peer`'s channel (credit_sink, waiter), asked
 * once and kept in `cache`: borrowed, Py_None for none (or no channel yet),
 * NULL with an error. */
static PyObject *channel_part(Hop *self, PyObject *cache, PyObject *peer, PyObject *method) {
    PyObject *part = PyDict_GetItemWithError(cache, peer);
    if (part || PyErr_Occurred())
        return part;
    PyObject *ch = PyDict_GetItemWithError(self->channels, peer);
    if (!ch)
        return PyErr_Occurred() ? NULL : Py_None;
    part = PyObject_CallMethodNoArgs(ch, method);
    if (!part || PyDict_SetItem(cache, peer, part) < 0) {
        Py_XDECREF(part);
        return NULL;
    }
    Py_DECREF(part);                              /* the cache holds it */
    return part;
}

/* args[0..n) of a call: positional, then keywords by these names; 0, or -1
 * for anything else (the Python path then raises the TypeError it would). */
static int hop_args(PyObject *const *args, size_t nargsf, PyObject *kwnames, const char *const *names, int n,
                    PyObject **out) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs > n)
        return -1;
    for (int i = 0; i < n; i++)
        out[i] = i < nargs ? args[i] : NULL;
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t k = 0; k < nkw; k++) {
        int found = 0;
        for (int i = (int)nargs; i < n && !found; i++)
            if (!out[i] && PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, k), names[i]) == 0) {
                out[i] = args[nargs + k];
                found = 1;
            }
        if (!found)
            return -1;
    }
    return 0;
}

/* Nothing failed: the session, and (check_peer) the pair with `peer`. 1, 0, or -1 with an error. */
static int hop_healthy(Hop *self, PyObject *peer, int check_peer) {
    PyObject *err = PyObject_GetAttr(self->live, error_name);
    if (!err)
        return -1;
    int ok = err == Py_None;
    Py_DECREF(err);
    if (ok && check_peer) {
        int lost = PyDict_Contains(self->peer_errors, peer);
        if (lost < 0)
            return -1;
        ok = !lost;
    }
    return ok;
}

/* After a write: the sender takes in its completions and credits itself
 * (the channel's waiter(None)), so its background thread is not woken for
 * each: on SoftRoCE that thread takes the CPU the sender's NIC runs on. The
 * write went; what the look finds wrong is the channel's error, which the
 * next call reports. */
static void hop_look(Hop *self, PyObject *peer) {
    PyObject *w = channel_part(self, self->waiters, peer, waiter_name);
    PyObject *r = w && w != Py_None ? PyObject_CallOneArg(w, Py_None) : NULL;
    Py_XDECREF(r);
    if (!r)
        PyErr_Clear();
}

static PyObject *Hop_send(Hop *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    static const char *const names[] = {"name", "array", "timeout", "tag"};
    PyObject *a[4];
    if (hop_args(args, nargsf, kwnames, names, 4, a) == 0 && a[0] && a[1]
        && (!a[3] || (PyLong_CheckExact(a[3]) && PyLong_AsLong(a[3]) == 0))) {
        PyObject *found = PyDict_GetItemWithError(self->send_slots, a[0]);
        if (!found && PyErr_Occurred())
            return NULL;
        SendState *st = (SendState *)found;
        if (st && PyObject_TypeCheck(found, &SendStateType) && st->view && a[1] == st->view
            && st->view != Py_None && st->seal && st->raw == Py_True && st->post && st->post != Py_None && st->credit
            && PyObject_TypeCheck(st->credit, &FlagType) && ((Flag *)st->credit)->flag
            && st->peer && st->writes && st->bytes_sent && st->nbytes) {
            int ok = hop_healthy(self, st->peer, 1);
            if (ok < 0)
                return NULL;
            if (ok) {                             /* counted while this thread holds the credit, before the write */
                PyObject *writes = Py_NewRef(st->writes), *bytes = Py_NewRef(st->bytes_sent);
                PyObject *more_writes = PyNumber_Add(writes, one);
                PyObject *more_bytes = more_writes ? PyNumber_Add(bytes, st->nbytes) : NULL;
                if (!more_bytes) {
                    Py_XDECREF(more_writes);
                    Py_DECREF(writes);
                    Py_DECREF(bytes);
                    return NULL;
                }
                Flag *credit = (Flag *)Py_NewRef(st->credit);
                PyObject *post = Py_NewRef(st->post);
                Py_INCREF(found);
                credit->flag = 0;
                Py_SETREF(st->writes, more_writes);
                Py_SETREF(st->bytes_sent, more_bytes);
                PyObject *number = PyObject_CallNoArgs(post);
                int posted = number ? PyObject_IsTrue(number) : -1;
                Py_DECREF(post);
                if (posted == 1) {
                    Py_XSETREF(st->pending, number);
                    /* read-only until buffer() hands it out again: a refill races the write */
                    PyObject *sealed = PyObject_CallOneArg(st->seal, Py_False);
                    Py_XDECREF(sealed);
                    if (!sealed)
                        PyErr_Clear();            /* never fails (any array may become read-only); the write went */
                    Py_DECREF(writes);
                    Py_DECREF(bytes);
                    Py_DECREF(credit);
                    hop_look(self, st->peer);
                    Py_DECREF(found);
                    Py_RETURN_NONE;
                }
                Py_XDECREF(number);               /* refused (0) or failed: nothing was posted */
                Py_SETREF(st->writes, writes);
                Py_SETREF(st->bytes_sent, bytes);
                if (posted < 0)
                    PyErr_Clear();                /* the checked path below says what is wrong */
                int set = flag_set(credit);
                Py_DECREF(credit);
                Py_DECREF(found);
                if (set < 0)
                    return NULL;
            }
        }
    } else if (PyErr_Occurred()) {
        PyErr_Clear();                            /* a tag that is no small int: the Python path judges it */
    }
    return PyObject_Vectorcall(self->send_rest, args, nargsf, kwnames);
}

static PyObject *Hop_recv(Hop *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    static const char *const names[] = {"name", "timeout", "tag"};
    PyObject *a[3];
    if (hop_args(args, nargsf, kwnames, names, 3, a) < 0 || !a[0])
        goto rest;
    PyObject *found = PyDict_GetItemWithError(self->recv_slots, a[0]);
    if (!found) {
        if (PyErr_Occurred())
            return NULL;
        goto rest;
    }
    if (!PyObject_TypeCheck(found, &SlotStateType) || !((SlotState *)found)->arrived || !((SlotState *)found)->peer)
        goto rest;
    SlotState *st = (SlotState *)found;
    int ok = hop_healthy(self, st->peer, st->state != FULL);   /* a value that is in is delivered */
    if (ok <= 0)
        return ok < 0 ? NULL : PyObject_Vectorcall(self->recv_rest, args, nargsf, kwnames);
    Py_INCREF(found);
    PyObject *result = NULL;
    if (st->state != FULL) {
        if (st->state != EMPTY || st->woken || st->arrived->flag)
            goto rest_held;
        PyObject *timeout = a[1] && a[1] != Py_None ? (Py_INCREF(a[1]), a[1]) : PyObject_GetAttr(self->ctx, timeout_name);
        PyObject *peer = timeout ? st->peer : NULL;
        PyObject *ch = peer ? PyDict_GetItemWithError(self->channels, peer) : NULL;
        if (!ch) {
            Py_XDECREF(timeout);
            if (PyErr_Occurred())
                goto done;
            goto rest_held;
        }
        Py_INCREF(ch);
        PyObject *arrived = NULL, *waiter = channel_part(self, self->waiters, peer, waiter_name);
        if (!waiter) {                            /* none to be had now: wait_for() waits, and says what is wrong */
            PyErr_Clear();
            waiter = Py_None;
        }
        int failed = 0;
        if (waiter != Py_None) {                  /* a compiled spin first; wait_for() decides the rest */
            Py_INCREF(waiter);
            PyObject *wait_args[] = {(PyObject *)st->arrived, timeout};     /* spins no longer than that */
            arrived = PyObject_Vectorcall(waiter, wait_args, 2, NULL);
            Py_DECREF(waiter);
            failed = !arrived;
            if (arrived == Py_None)
                Py_CLEAR(arrived);
        }
        if (!arrived && !failed)
            arrived = PyObject_CallMethodObjArgs(ch, wait_for_name, (PyObject *)st->arrived, timeout, NULL);
        Py_DECREF(ch);
        int in = arrived ? PyObject_IsTrue(arrived) : -1;
        Py_XDECREF(arrived);
        if (in <= 0) {
            if (in == 0)    /* raises: the peer's error, or RecvTimeout */
                result = PyObject_CallFunctionObjArgs(self->timed_out, found, a[0], timeout, NULL);
            Py_DECREF(timeout);
            goto done;
        }
        Py_DECREF(timeout);
        if (st->state != FULL)                    /* woken by a failure: the Python path says which */
            goto rest_held;
    }
    if (a[2] && a[2] != Py_None) {                /* another call's value is the Python path's to refuse */
        unsigned long tag = PyLong_AsUnsignedLong(a[2]);
        if (tag == (unsigned long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            goto rest_held;
        }
        if (tag != st->tag)
            goto rest_held;
    }
    if (!st->view || st->view == Py_None)         /* framed, or not viewed yet: decoded in Python */
        goto rest_held;
    Received *r = (Received *)ReceivedType.tp_alloc(&ReceivedType, 0);
    if (!r)
        goto done;
    st->state = HELD;
    if (received_fill(r, (PyObject *)self, found, st->view) < 0) {
        st->state = FULL;
        Py_DECREF(r);
        goto done;
    }
    result = (PyObject *)r;
done:
    Py_DECREF(found);
    return result;
rest_held:
    Py_DECREF(found);
rest:
    return PyObject_Vectorcall(self->recv_rest, args, nargsf, kwnames);
}

/* A released slot goes back: EMPTY, and its credit owed to the next write to
 * the sender where the channel's credit_sink takes it, else as Python gives
 * it (Credits.return_credit). */
static PyObject *hop_give_back(PyObject *hop, SlotState *st) {
    Hop *self = (Hop *)hop;
    slot_release(st);
    PyObject *closed = PyObject_GetAttr(self->ctx, closed_name);
    int is_closed = closed ? PyObject_IsTrue(closed) : -1;
    Py_XDECREF(closed);
    if (is_closed)
        return is_closed < 0 ? NULL : Py_NewRef(Py_None);
    if (!st->peer || !st->credit_imm)             /* not a session's slot: the Python path says why */
        return PyObject_CallOneArg(self->return_credit, (PyObject *)st);
    int lost = PyDict_Contains(self->peer_errors, st->peer);
    PyObject *sink = lost ? NULL : channel_part(self, self->sinks, st->peer, credit_sink_name);
    if (lost)
        return lost < 0 ? NULL : Py_NewRef(Py_None);
    if (!sink)
        return NULL;
    if (sink != Py_None) {
        Py_INCREF(sink);
        PyObject *taken = PyObject_CallOneArg(sink, st->credit_imm);
        Py_DECREF(sink);
        int yes = taken ? PyObject_IsTrue(taken) : -1;
        Py_XDECREF(taken);
        if (yes == 1)
            Py_RETURN_NONE;
        PyErr_Clear();                            /* the Python path reports what is wrong */
    }
    return PyObject_CallOneArg(self->return_credit, (PyObject *)st);
}

static int Hop_init(Hop *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"send_slots", "recv_slots", "live", "ctx", "send", "recv", "timed_out",
                            "return_credit", NULL};
    PyObject *send_slots, *recv_slots, *live, *ctx, *send_rest, *recv_rest, *timed_out, *return_credit;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!O!OOOOOO", names, &PyDict_Type, &send_slots, &PyDict_Type,
                                     &recv_slots, &live, &ctx, &send_rest, &recv_rest, &timed_out, &return_credit))
        return -1;
    PyObject *peer_errors = PyObject_GetAttrString(live, "peer_errors");
    PyObject *channels = peer_errors ? PyObject_GetAttrString(ctx, "channels") : NULL;
    PyObject *sinks = channels ? PyDict_New() : NULL;
    PyObject *waiters = sinks ? PyDict_New() : NULL;
    if (!waiters || !PyDict_Check(peer_errors) || !PyDict_Check(channels)) {
        if (waiters)
            PyErr_SetString(PyExc_TypeError, "live.peer_errors and ctx.channels are dicts");
        Py_XDECREF(peer_errors);
        Py_XDECREF(channels);
        Py_XDECREF(sinks);
        Py_XDECREF(waiters);
        return -1;
    }
    PyObject *keep[] = {send_slots, recv_slots, live, ctx, send_rest, recv_rest, timed_out, return_credit};
    for (int i = 0; i < 8; i++)
        Py_INCREF(keep[i]);
    Py_XSETREF(self->send_slots, send_slots);
    Py_XSETREF(self->recv_slots, recv_slots);
    Py_XSETREF(self->live, live);
    Py_XSETREF(self->ctx, ctx);
    Py_XSETREF(self->send_rest, send_rest);
    Py_XSETREF(self->recv_rest, recv_rest);
    Py_XSETREF(self->timed_out, timed_out);
    Py_XSETREF(self->return_credit, return_credit);
    Py_XSETREF(self->peer_errors, peer_errors);
    Py_XSETREF(self->channels, channels);
    Py_XSETREF(self->sinks, sinks);
    Py_XSETREF(self->waiters, waiters);
    return 0;
}

static int Hop_traverse(Hop *self, visitproc visit, void *arg) {
    Py_VISIT(self->send_slots);
    Py_VISIT(self->recv_slots);
    Py_VISIT(self->live);
    Py_VISIT(self->peer_errors);
    Py_VISIT(self->ctx);
    Py_VISIT(self->channels);
    Py_VISIT(self->sinks);
    Py_VISIT(self->waiters);
    Py_VISIT(self->send_rest);
    Py_VISIT(self->recv_rest);
    Py_VISIT(self->timed_out);
    Py_VISIT(self->return_credit);
    return 0;
}

static int Hop_clear(Hop *self) {
    Py_CLEAR(self->send_slots);
    Py_CLEAR(self->recv_slots);
    Py_CLEAR(self->live);
    Py_CLEAR(self->peer_errors);
    Py_CLEAR(self->ctx);
    Py_CLEAR(self->channels);
    Py_CLEAR(self->sinks);
    Py_CLEAR(self->waiters);
    Py_CLEAR(self->send_rest);
    Py_CLEAR(self->recv_rest);
    Py_CLEAR(self->timed_out);
    Py_CLEAR(self->return_credit);
    return 0;
}

static void Hop_dealloc(Hop *self) {
    PyObject_GC_UnTrack(self);
    Hop_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Hop_give_back(Hop *self, PyObject *st) {
    if (!PyObject_TypeCheck(st, &SlotStateType) || !((SlotState *)st)->arrived) {
        PyErr_SetString(PyExc_TypeError, "give_back() takes a SlotState");
        return NULL;
    }
    return hop_give_back((PyObject *)self, (SlotState *)st);
}

static PyMethodDef Hop_methods[] = {
    {"send", (PyCFunction)(void (*)(void))Hop_send, METH_FASTCALL | METH_KEYWORDS,
     "send(name, array, timeout=None, tag=0): Session.send"},
    {"recv", (PyCFunction)(void (*)(void))Hop_recv, METH_FASTCALL | METH_KEYWORDS,
     "recv(name, timeout=None, tag=None): Session.recv"},
    {"give_back", (PyCFunction)Hop_give_back, METH_O, "give_back(slot): Credits.give_back"},
    {NULL},
};

static PyTypeObject HopType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "rdmatensor.session._slots.Hop",
    .tp_basicsize = sizeof(Hop),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Hop(send_slots, recv_slots, live, ctx, send, recv, timed_out, return_credit): a session's "
              "send(), recv() and release, compiled for the common case, the Python path for the rest",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Hop_init,
    .tp_traverse = (traverseproc)Hop_traverse,
    .tp_clear = (inquiry)Hop_clear,
    .tp_dealloc = (destructor)Hop_dealloc,
    .tp_methods = Hop_methods,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_slots", "Slot state and immediates, compiled.", -1, NULL};

PyMODINIT_FUNC PyInit__slots(void) {
    wake_name = PyUnicode_InternFromString("_wake");
    empty_str = PyUnicode_InternFromString("empty");
    full_str = PyUnicode_InternFromString("full");
    held_str = PyUnicode_InternFromString("held");
    give_back_name = PyUnicode_InternFromString("give_back");
    name_name = PyUnicode_InternFromString("name");
    nbytes_name = PyUnicode_InternFromString("nbytes");
    error_name = PyUnicode_InternFromString("error");
    closed_name = PyUnicode_InternFromString("closed");
    timeout_name = PyUnicode_InternFromString("timeout");
    wait_for_name = PyUnicode_InternFromString("wait_for");
    credit_sink_name = PyUnicode_InternFromString("credit_sink");
    waiter_name = PyUnicode_InternFromString("waiter");
    one = PyLong_FromLong(1);
    if (!wake_name || !empty_str || !full_str || !held_str || !give_back_name || !name_name || !nbytes_name
        || !error_name || !closed_name || !timeout_name || !wait_for_name || !credit_sink_name
        || !waiter_name || !one)
        return NULL;
    if (PyType_Ready(&FlagType) < 0 || PyType_Ready(&SlotStateType) < 0 || PyType_Ready(&ImmediatesType) < 0
        || PyType_Ready(&ReceivedType) < 0 || PyType_Ready(&SendStateType) < 0 || PyType_Ready(&HopType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    PyTypeObject *types[] = {&FlagType, &SlotStateType, &ImmediatesType, &ReceivedType, &SendStateType, &HopType};
    const char *names[] = {"Flag", "SlotState", "Immediates", "Received", "SendState", "Hop"};
    for (int i = 0; i < 6; i++) {
        Py_INCREF(types[i]);
        if (PyModule_AddObject(m, names[i], (PyObject *)types[i]) < 0) {
            Py_DECREF(types[i]);
            Py_DECREF(m);
            return NULL;
        }
    }
    return m;
}
