/* A slot's state and the immediates that move it, compiled (credits.py and
 * flag.py have the same in Python, and the contract).
 *
 * Every tensor moves two flags and one small state machine: its DATA
 * immediate makes the receiver's slot FULL, recv() takes it, release() empties
 * it and its CREDIT immediate gives the sender its credit back.  In Python
 * that was about 1.6 us of a round trip's 8 (a lock per transition, a call
 * per step).  Here each transition is a few stores under the GIL, which also
 * makes it atomic with respect to every other thread: no lock is needed.
 *
 *   Flag          is_set / set / clear; set() calls self._wake() only while
 *                 a thread sleeps on it (flag.py's Flag adds wait()).
 *   SlotState     EMPTY --arrive--> FULL --take--> HELD --release--> EMPTY,
 *                 wake(), and replace() of its memory only while EMPTY.
 *   Immediates    a channel's on_imm: DATA, CREDIT and PAIR for bound slots, in C;
 *                 anything else goes to the Python on_imm, which raises what
 *                 the rules say (credits.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>

#define IMM_DATA 0               /* providers/base.py's kinds */
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

static PyObject *SlotState_release(SlotState *self, PyObject *unused) {
    if (!ready(self))
        return NULL;
    self->state = EMPTY;
    if (!self->woken)            /* a loss must keep waking later waiters */
        self->arrived->flag = 0;
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
    return 0;
}

static int SlotState_clear(SlotState *self) {
    Py_CLEAR(self->arrived);
    Py_CLEAR(self->memory);
    Py_CLEAR(self->view);
    Py_CLEAR(self->grown);
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

static int Received_init(Received *self, PyObject *args, PyObject *kw) {
    PyObject *credits, *state, *array;
    static char *names[] = {"credits", "state", "array", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO!O", names, &credits, &SlotStateType, &state, &array))
        return -1;
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

static PyObject *Received_release(Received *self, PyObject *unused) {
    if (!self->state || self->state == Py_None)
        Py_RETURN_NONE;
    PyObject *state = self->state;
    self->state = NULL;
    Py_INCREF(Py_None);
    Py_XSETREF(self->array, Py_None);
    PyObject *r = self->credits ? PyObject_CallMethodOneArg(self->credits, give_back_name, state) : NULL;
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

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_slots", "Slot state and immediates, compiled.", -1, NULL};

PyMODINIT_FUNC PyInit__slots(void) {
    wake_name = PyUnicode_InternFromString("_wake");
    empty_str = PyUnicode_InternFromString("empty");
    full_str = PyUnicode_InternFromString("full");
    held_str = PyUnicode_InternFromString("held");
    give_back_name = PyUnicode_InternFromString("give_back");
    name_name = PyUnicode_InternFromString("name");
    nbytes_name = PyUnicode_InternFromString("nbytes");
    if (!wake_name || !empty_str || !full_str || !held_str || !give_back_name || !name_name || !nbytes_name)
        return NULL;
    if (PyType_Ready(&FlagType) < 0 || PyType_Ready(&SlotStateType) < 0 || PyType_Ready(&ImmediatesType) < 0
        || PyType_Ready(&ReceivedType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    PyTypeObject *types[] = {&FlagType, &SlotStateType, &ImmediatesType, &ReceivedType};
    const char *names[] = {"Flag", "SlotState", "Immediates", "Received"};
    for (int i = 0; i < 4; i++) {
        Py_INCREF(types[i]);
        if (PyModule_AddObject(m, names[i], (PyObject *)types[i]) < 0) {
            Py_DECREF(types[i]);
            Py_DECREF(m);
            return NULL;
        }
    }
    return m;
}
